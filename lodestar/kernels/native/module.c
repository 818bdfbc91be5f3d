/* lodestar.kernels._native: packed integer matrix products for the CPU (see qmatmul.h).
 *
 * Functions take raw addresses (torch's data_ptr()) and sizes; the caller (Python,
 * lodestar.kernels.cpu_quant) checks shapes, dtypes and contiguity. The GIL is released
 * while they run. Threads come from OpenMP, which resolves to the runtime torch loaded, so
 * torch.set_num_threads governs these kernels too. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "decoder.h"
#include "ops.h"
#include "pack.h"
#include "qmatmul.h"

typedef struct {
    const char *name;
    qmm_tile_fn fn;
    int (*supported)(void);
} isa_entry;

static int always(void) { return 1; }
#if defined(__x86_64__) || defined(_M_X64)
static int has_avx2(void) { return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c"); }
static int has_avx512vnni(void) {
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
}
#endif

/* Best first. An ARM NEON kernel goes here with its own file. */
static const isa_entry ISAS[] = {
#if defined(__x86_64__) || defined(_M_X64)
    {"avx512vnni", qmm_tile_avx512vnni, has_avx512vnni},
    {"avx2", qmm_tile_avx2, has_avx2},
#endif
    {"generic", qmm_tile_generic, always},
};
#define N_ISAS (sizeof(ISAS) / sizeof(ISAS[0]))

static const isa_entry *current = NULL;

/* quantize_x built for several instruction sets (rounding and the digit split vectorize
 * with AVX2); every build gives the same bits. */
#if defined(__x86_64__) && defined(__has_attribute)
#if __has_attribute(target_clones)
#define QX_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#endif
#endif
#ifndef QX_CLONES
#define QX_CLONES
#endif

static const isa_entry *best_isa(void) {
    for (size_t i = 0; i < N_ISAS; i++)
        if (ISAS[i].supported()) return &ISAS[i];
    return &ISAS[N_ISAS - 1];
}

/* x [m, k] fp32 -> the digits q1, q2 of Q = rint(x * XLEVELS/amax) = 254*q1 + q2, d_x =
 * amax/XLEVELS and sx = d_x * sum(Q) per 32 values, sums of Q per 16 values. The same
 * operations as cpu_quant.quantize_x, so the same bits. */
QX_CLONES static void quantize_x(const float *x, int64_t m, int64_t k, int8_t *q1, int8_t *q2, float *dx,
                                 int32_t *xsum, float *sx) {
    const int64_t nb = k / XBLOCK;
#pragma omp parallel for schedule(static) if (m >= 8)
    for (int64_t i = 0; i < m; i++) {
        for (int64_t b = 0; b < nb; b++) {
            const float *v = x + i * k + b * XBLOCK;
            float amax = 0.0f;
            for (int e = 0; e < XBLOCK; e++) {
                const float av = fabsf(v[e]);
                amax = (av > amax || av != av) ? av : amax;   /* a NaN stays: the block's d_x is NaN, as torch's */
            }
            const float d = amax / XLEVELS;
            const float inv = amax > 0.0f ? XLEVELS / amax : 0.0f;
            const int64_t at = i * k + b * XBLOCK;
            int32_t s[2] = {0, 0};
            for (int e = 0; e < XBLOCK; e++) {
                float r = rintf(v[e] * inv);
                r = r > XLEVELS ? XLEVELS : (r < -XLEVELS ? -XLEVELS : (r == r ? r : 0.0f));
                const int32_t big = (int32_t)r;
                /* floor((Q + 127) / 254) for Q >= -32385, so that q2 = Q - 254*q1 is in -127..126 */
                const int32_t hi = (big + 127 + 254 * 128) / 254 - 128;
                q1[at + e] = (int8_t)hi;
                q2[at + e] = (int8_t)(big - 254 * hi);
                s[e / 16] += big;
            }
            dx[i * nb + b] = d;
            xsum[i * 2 * nb + 2 * b] = s[0];
            xsum[i * 2 * nb + 2 * b + 1] = s[1];
            sx[i * nb + b] = d * (float)(s[0] + s[1]);
        }
    }
}

static void *as_ptr(unsigned long long v) { return (void *)(uintptr_t)v; }

static PyObject *py_quantize(PyObject *self, PyObject *args) {
    unsigned long long x, q1, q2, dx, xsum, sx;
    long long m, k;
    if (!PyArg_ParseTuple(args, "KLLKKKKK", &x, &m, &k, &q1, &q2, &dx, &xsum, &sx)) return NULL;
    if (m < 0 || k <= 0 || k % XBLOCK) {
        PyErr_SetString(PyExc_ValueError, "quantize: k must be a positive multiple of 32");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    quantize_x(as_ptr(x), m, k, as_ptr(q1), as_ptr(q2), as_ptr(dx), as_ptr(xsum), as_ptr(sx));
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

int qmm_run(const float *x, int64_t m, int64_t k, float *out, int64_t n, const uint8_t *codes, const void *scales,
            const void *mins, int half, int gs, int bits, int code_bits, int offset) {
    if (m == 0) return 0;
    const int64_t nb = k / XBLOCK;
    char *scratch = malloc((size_t)(2 * m * k + m * nb * 4 * 4 + 64));
    if (!scratch) return -1;
    qmm_args a = {
        .m = m, .n = n, .k = k, .gs = gs, .bits = bits, .code_bits = code_bits, .offset = offset,
        .has_min = mins != NULL, .half = half, .codes = codes, .scales = scales, .mins = mins, .out = out,
    };
    float *dx = (float *)scratch;
    float *sx = dx + m * nb;
    int32_t *xsum = (int32_t *)(sx + m * nb);
    int8_t *q1 = (int8_t *)(xsum + m * nb * 2), *q2 = q1 + m * k;
    a.q1 = q1, a.q2 = q2, a.dx = dx, a.xsum = xsum, a.sx = sx;
    const qmm_tile_fn fn = current->fn;
    const int64_t tiles = (n + TILE_ROWS - 1) / TILE_ROWS;
    const int64_t chunks = (m + M_CHUNK - 1) / M_CHUNK;
    const int64_t items = tiles * chunks;
    const int parallel = (double)m * n * k >= 65536.0 && items > 1;
    quantize_x(x, m, k, q1, q2, dx, xsum, sx);
#pragma omp parallel for schedule(static) if (parallel)
    for (int64_t it = 0; it < items; it++) {
        const int64_t tile = it % tiles, c = it / tiles;
        const int64_t m0 = c * M_CHUNK, m1 = m0 + M_CHUNK < m ? m0 + M_CHUNK : m;
        fn(&a, tile, m0, m1);
    }
    free(scratch);
    return 0;
}

static int layout_ok(long long m, long long n, long long k, int gs, int bits, int has_min) {
    return m >= 0 && n > 0 && k > 0 && k % XBLOCK == 0 && (gs == 16 || gs == 32) && k % gs == 0 &&
           (bits == 4 || bits == 8) && (!has_min || gs == 32);
}

static PyObject *py_matmul(PyObject *self, PyObject *args) {
    unsigned long long x, out, codes, scales, mins;
    long long m, k, n;
    int half, gs, bits, code_bits, offset;
    if (!PyArg_ParseTuple(args, "KLLKLKKKiiiii", &x, &m, &k, &out, &n, &codes, &scales, &mins, &half, &gs, &bits,
                          &code_bits, &offset))
        return NULL;
    if (!layout_ok(m, n, k, gs, bits, mins != 0)) {
        PyErr_SetString(PyExc_ValueError, "matmul: unsupported shape or block layout");
        return NULL;
    }
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = qmm_run(as_ptr(x), m, k, as_ptr(out), n, as_ptr(codes), as_ptr(scales), as_ptr(mins), half != 0, gs, bits,
                 code_bits, offset);
    Py_END_ALLOW_THREADS
    if (rc) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyObject *py_llama_layers(PyObject *self, PyObject *args) {
    unsigned long long h, layers, pos, slots, rows, seqs, lens, tables;
    long long t, n_layers, d, hq, hk, dim, ffn, rot, n_rows, width, bs;
    float eps, scale;
    int act;
    if (!PyArg_ParseTuple(args, "KLKLLLLLLLffiKKLKKKKLL", &h, &t, &layers, &n_layers, &d, &hq, &hk, &dim, &ffn, &rot,
                          &eps, &scale, &act, &pos, &slots, &n_rows, &rows, &seqs, &lens, &tables, &width, &bs))
        return NULL;
    if (hk <= 0 || hq % hk) {
        PyErr_SetString(PyExc_ValueError, "llama_layers: query heads must be a multiple of KV heads");
        return NULL;
    }
    const int64_t *L = as_ptr(layers);
    for (long long l = 0; l < n_layers; l++) {
        const int64_t *layer = L + l * LAYER_FIELDS, parts = layer[L_QKV_PARTS];
        const int fields[6] = {L_QKV, L_O, L_GATE_UP, L_DOWN, L_QKV_K, L_QKV_V};
        if (parts != 1 && parts != 3) {
            PyErr_SetString(PyExc_ValueError, "llama_layers: q|k|v must come in 1 or 3 parts");
            return NULL;
        }
        for (int w = 0; w < (parts == 3 ? 6 : 4); w++) {
            const int64_t *f = layer + fields[w];
            if (!layout_ok(t, f[W_N], f[W_K], (int)f[W_GS], (int)f[W_BITS], f[W_MINS] != 0)) {
                PyErr_SetString(PyExc_ValueError, "llama_layers: unsupported weight layout");
                return NULL;
            }
        }
    }
    llama_step s = {.h = as_ptr(h), .t = t, .n_layers = n_layers, .d = d, .hq = hq, .hk = hk, .dim = dim, .ffn = ffn,
                    .rot = rot, .eps = eps, .scale = scale, .act = act, .layers = L, .positions = as_ptr(pos),
                    .slots = as_ptr(slots), .n_rows = n_rows, .rows = as_ptr(rows), .seqs = as_ptr(seqs),
                    .lens = as_ptr(lens), .tables = as_ptr(tables), .table_width = width, .block_size = bs};
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = llama_layers(&s);
    Py_END_ALLOW_THREADS
    if (rc) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyObject *py_rms_norm(PyObject *self, PyObject *args) {
    unsigned long long x, res, h, out, w;
    long long rows, dim;
    float eps;
    if (!PyArg_ParseTuple(args, "KKKKKLLf", &x, &res, &h, &out, &w, &rows, &dim, &eps)) return NULL;
    Py_BEGIN_ALLOW_THREADS
    ops_rms_norm(as_ptr(x), as_ptr(res), as_ptr(h), as_ptr(out), as_ptr(w), rows, dim, eps);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *py_glu(PyObject *self, PyObject *args) {
    unsigned long long gate_up, out;
    long long rows, ffn;
    int kind;
    if (!PyArg_ParseTuple(args, "KKLLi", &gate_up, &out, &rows, &ffn, &kind)) return NULL;
    Py_BEGIN_ALLOW_THREADS
    ops_glu(as_ptr(gate_up), as_ptr(out), rows, ffn, kind);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *py_rope_store(PyObject *self, PyObject *args) {
    unsigned long long q, k, v, pos, slots, cs, sn, kc, vc;
    long long qs, ks, vs, rows, hq, hk, dim, rot;
    if (!PyArg_ParseTuple(args, "KKKLLLLLLLLKKKKKK", &q, &k, &v, &qs, &ks, &vs, &rows, &hq, &hk, &dim, &rot, &pos,
                          &slots, &cs, &sn, &kc, &vc))
        return NULL;
    rope_args a = {.q = as_ptr(q), .k = as_ptr(k), .v = as_ptr(v), .q_stride = qs, .k_stride = ks, .v_stride = vs,
                   .rows = rows, .hq = hq, .hk = hk, .dim = dim, .rot = rot, .positions = as_ptr(pos),
                   .slots = as_ptr(slots), .cos = as_ptr(cs), .sin = as_ptr(sn), .k_cache = as_ptr(kc),
                   .v_cache = as_ptr(vc)};
    Py_BEGIN_ALLOW_THREADS
    ops_rope_store(&a);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *py_attend(PyObject *self, PyObject *args) {
    unsigned long long q, kc, vc, out, rows, seqs, lens, starts, tables;
    long long qs, hq, hk, dim, n, width, bs;
    float scale;
    if (!PyArg_ParseTuple(args, "KLLLLKKKfLKKKKKLL", &q, &qs, &hq, &hk, &dim, &kc, &vc, &out, &scale, &n, &rows, &seqs,
                          &lens, &starts, &tables, &width, &bs))
        return NULL;
    if (hk <= 0 || hq % hk) {
        PyErr_SetString(PyExc_ValueError, "attend: query heads must be a multiple of KV heads");
        return NULL;
    }
    attend_args a = {.q = as_ptr(q), .q_stride = qs, .hq = hq, .hk = hk, .dim = dim, .k_cache = as_ptr(kc),
                     .v_cache = as_ptr(vc), .out = as_ptr(out), .scale = scale, .n = n, .rows = as_ptr(rows),
                     .seqs = as_ptr(seqs), .lens = as_ptr(lens), .starts = as_ptr(starts), .tables = as_ptr(tables),
                     .table_width = width, .block_size = bs};
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = ops_attend(&a);
    Py_END_ALLOW_THREADS
    if (rc) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyObject *py_pack(PyObject *self, PyObject *args) {
    unsigned long long data, codes, scales, mins;
    long long n, k;
    int type;
    if (!PyArg_ParseTuple(args, "iKLLKKK", &type, &data, &n, &k, &codes, &scales, &mins)) return NULL;
    int block, bytes, gs, has_min;
    if (n <= 0 || k <= 0 || pack_block_info(type, &block, &bytes, &gs, &has_min) || k % block ||
        has_min != (mins != 0)) {
        PyErr_SetString(PyExc_ValueError, "pack: unsupported type, shape or mins");
        return NULL;
    }
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = pack_tiles(type, as_ptr(data), n, k, as_ptr(codes), as_ptr(scales), as_ptr(mins));
    Py_END_ALLOW_THREADS
    if (rc) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyObject *py_half_scales(PyObject *self, PyObject *args) {
    int type, block, bytes, gs, has_min;
    if (!PyArg_ParseTuple(args, "i", &type)) return NULL;
    if (pack_block_info(type, &block, &bytes, &gs, &has_min)) {
        PyErr_SetString(PyExc_ValueError, "half_scales: a type without an integer form");
        return NULL;
    }
    return PyBool_FromLong(pack_half_scales(type));
}

static PyObject *py_isa(PyObject *self, PyObject *noargs) { return PyUnicode_FromString(current->name); }

static PyObject *py_isas(PyObject *self, PyObject *noargs) {
    PyObject *out = PyList_New(0);
    if (!out) return NULL;
    for (size_t i = 0; i < N_ISAS; i++) {
        if (!ISAS[i].supported()) continue;
        PyObject *s = PyUnicode_FromString(ISAS[i].name);
        if (!s || PyList_Append(out, s) < 0) {
            Py_XDECREF(s);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(s);
    }
    return out;
}

static PyObject *py_set_isa(PyObject *self, PyObject *args) {
    const char *name;
    if (!PyArg_ParseTuple(args, "s", &name)) return NULL;
    for (size_t i = 0; i < N_ISAS; i++) {
        if (strcmp(ISAS[i].name, name) == 0) {
            if (!ISAS[i].supported()) break;
            const char *before = current->name;
            current = &ISAS[i];
            return PyUnicode_FromString(before);
        }
    }
    PyErr_Format(PyExc_ValueError, "instruction set %s is not available on this CPU", name);
    return NULL;
}

static PyMethodDef METHODS[] = {
    {"matmul", py_matmul, METH_VARARGS,
     "matmul(x, m, k, out, n, codes, scales, mins, half, gs, bits, code_bits, offset): out[m, n] = x[m, k] @ W.T"},
    {"quantize", py_quantize, METH_VARARGS, "quantize(x, m, k, q1, q2, dx, xsum, sx): x's int8 digits per block"},
    {"llama_layers", py_llama_layers, METH_VARARGS,
     "llama_layers(h, t, layers, n_layers, d, hq, hk, dim, ffn, rot, eps, scale, act, positions, slots, n_rows, "
     "rows, seqs, lens, tables, width, block_size): every decoder layer of a step, h in place"},
    {"rms_norm", py_rms_norm, METH_VARARGS, "rms_norm(x, res, h, out, w, rows, dim, eps)"},
    {"glu", py_glu, METH_VARARGS, "glu(gate_up, out, rows, ffn, kind): act(gate) * up"},
    {"rope_store", py_rope_store, METH_VARARGS,
     "rope_store(q, k, v, q_stride, k_stride, v_stride, rows, hq, hk, dim, rot, positions, slots, cos, sin, "
     "k_cache, v_cache)"},
    {"attend", py_attend, METH_VARARGS,
     "attend(q, q_stride, hq, hk, dim, k_cache, v_cache, out, scale, n, rows, seqs, lens, starts, tables, width, "
     "block_size)"},
    {"pack", py_pack, METH_VARARGS,
     "pack(type, data, n, k, codes, scales, mins): GGUF blocks [n, row bytes] -> the tile layout"},
    {"half_scales", py_half_scales, METH_VARARGS, "half_scales(type): pack keeps the type's scales and mins fp16"},
    {"isa", py_isa, METH_NOARGS, "The instruction set the kernels use."},
    {"isas", py_isas, METH_NOARGS, "The instruction sets this CPU can use, best first."},
    {"set_isa", py_set_isa, METH_VARARGS, "Use another available instruction set; returns the previous one."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef MODULE = {PyModuleDef_HEAD_INIT, "_native", "Packed integer CPU kernels.", -1, METHODS};

PyMODINIT_FUNC PyInit__native(void) {
    current = best_isa();
    PyObject *mod = PyModule_Create(&MODULE);
    if (mod) {
        PyModule_AddIntConstant(mod, "TILE_ROWS", TILE_ROWS);
        PyModule_AddIntConstant(mod, "WEIGHT_FIELDS", WEIGHT_FIELDS);
    }
    return mod;
}
