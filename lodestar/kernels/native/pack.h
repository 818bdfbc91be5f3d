/* Packing GGUF integer blocks into the tile layout of qmatmul.h (pack.c). */
#ifndef LODESTAR_PACK_H
#define LODESTAR_PACK_H

#include <stdint.h>

/* The layout of ggml type `type`: weights per GGUF block and its bytes, weights per scale,
 * whether it has mins. -1 for a type without an integer form. */
int pack_block_info(int type, int *block, int *bytes, int *gs, int *has_min);

/* Whether the type's scales and mins are fp16 in the tiles (they are fp16 fields in its
 * blocks), else fp32. */
int pack_half_scales(int type);

/* GGUF bytes [n][row bytes] -> codes [tiles][k/gs][TILE_ROWS*gs*bits/8], scales and mins
 * (NULL for a type without) [tiles][k/gs][TILE_ROWS]; a last partial tile's rows are zero.
 * 0 on success, -1 for a bad type or k, -2 out of memory. */
int pack_tiles(int type, const uint8_t *data, int64_t n, int64_t k, uint8_t *codes, void *scales, void *mins);

#endif
