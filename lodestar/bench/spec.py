"""``lodestar bench spec``: speculative decoding's speed-up, cost and exactness.

One in-process engine with speculation on (``EngineConfig.spec``); the baseline side sends
the same requests with ``SamplingParams(speculate=False)``, which decode one token per step
as an engine without speculation would (two engines over one model must not interleave).
Greedy, the same prompts and ``--max-tokens`` on both sides, EOS honoured. Parts:

- edit: a source file in the user message, to be returned with a function renamed, or
  whole and then extended (``spec_workloads``); one request at a time. Most of the answer
  copies the prompt, which n-gram drafting exploits.
- chat: short questions that copy nothing; one request at a time. The adaptive gamma
  should stop drafting, so the target is no loss: on/off >= ``TARGETS["chat"]``.
- batch: ``--streams`` edit requests at once: aggregate decode tok/s while every stream
  decodes (``serve_load.decode_rate``) and end to end.

Decode tok/s of a request: the tokens that arrive after its first / the time from its first
token to its last; time to first token is reported apart. A part's single-request figure
pools its prompts (their decode tokens / their decode seconds). Each run measures both
sides, in alternating order; ratios are on/off within one run, median [min–max] of
``--runs`` after one warm-up. Every request's greedy tokens must be the same on both sides
and in every run; a difference is printed (and fails ``--strict``).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
import traceback
from dataclasses import dataclass, field

import torch

from lodestar.bench import common
from lodestar.bench.common import Stat, device_info, git_commit, ids_hash
from lodestar.bench.serve_load import decode_rate
from lodestar.bench.spec_workloads import Task, chat_tasks, edit_tasks, task_ids

PARTS = ("edit", "chat", "batch")
SIDES = ("off", "on")
TARGETS = {"chat": 0.97}
SPEC_KEYS = ("spec_drafted", "spec_accepted", "spec_verify_steps", "spec_emitted")


# -- running requests --------------------------------------------------------------
@dataclass
class RequestRun:
    """One request's tokens, when they arrived, and its final speculation counters."""

    token_ids: list[int] = field(default_factory=list)
    arrivals: list[tuple[float, int]] = field(default_factory=list)    # (time, tokens that step)
    t_start: float = 0.0
    finish_reason: str | None = None
    cached_tokens: int = 0
    spec: object = None             # engine.spec.SpecStats of the last output, None when not speculating
    text: str = ""

    @property
    def ttft(self) -> float:
        return self.arrivals[0][0] - self.t_start if self.arrivals else math.nan

    @property
    def decode_seconds(self) -> float:
        return self.arrivals[-1][0] - self.arrivals[0][0] if self.arrivals else 0.0

    @property
    def decode_tokens(self) -> int:
        return sum(k for _, k in self.arrivals[1:])

    @property
    def decode_steps(self) -> int:
        return max(len(self.arrivals) - 1, 0)

    @property
    def decode_tok_s(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds > 0 else math.nan


@dataclass
class SideRun:
    """One side's requests in one run, and what the engine's speculation counters moved by."""

    requests: list[RequestRun]
    seconds: float
    engine_spec: dict[str, int] = field(default_factory=dict)


def drive(engine, prompts: list[list[int]], params: list) -> list[RequestRun]:
    """Add all requests, step the engine until they finish; results in prompt order."""
    def record(r: RequestRun, o, now: float) -> None:
        if o.token_ids:
            r.token_ids += o.token_ids
            r.arrivals.append((now, len(o.token_ids)))
        r.text += o.text
        r.cached_tokens = o.cached_tokens
        r.spec = dataclasses.replace(o.speculation) if o.speculation is not None else None
        if o.finished:
            r.finish_reason = o.finish_reason
    return common.drive(engine, prompts, params, lambda t0: RequestRun(t_start=t0), record)


def run_side(engine, prompts: list[list[int]], speculate: bool, max_tokens: int, together: bool) -> SideRun:
    """The prompts on one side, all at once (``together``) or one after another."""
    from lodestar.engine.sampling import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, speculate=speculate)
    before = {k: engine.stats.get(k, 0) for k in SPEC_KEYS}
    t0 = time.perf_counter()
    if together:
        requests = drive(engine, prompts, [params] * len(prompts))
    else:
        requests = [drive(engine, [p], [params])[0] for p in prompts]
    seconds = time.perf_counter() - t0
    return SideRun(requests, seconds, {k: engine.stats.get(k, 0) - before[k] for k in SPEC_KEYS})


def measure(engine, prompts: list[list[int]], max_tokens: int, runs: int, together: bool,
            progress=None) -> dict[str, list[SideRun]]:
    """Run 0 (the warm-up) and ``runs`` timed runs of both sides, the order alternating per run;
    ``progress(i, side, run)`` after each."""
    records: dict[str, list[SideRun]] = {s: [] for s in SIDES}
    for i in range(runs + 1):
        for side in (SIDES if i % 2 == 0 else SIDES[::-1]):
            records[side].append(run_side(engine, prompts, side == "on", max_tokens, together))
            if progress is not None:
                progress(i, side, records[side][-1])
    return records


# -- statistics --------------------------------------------------------------------
def side_rate(run: SideRun, together: bool) -> float:
    """Decode tok/s of one side's run: the requests' pooled decode rate, or for requests run
    together the aggregate rate while all of them decode."""
    if together:
        arrivals = [r.arrivals for r in run.requests if r.arrivals]
        return decode_rate(arrivals) if arrivals else math.nan
    seconds = sum(r.decode_seconds for r in run.requests)
    return sum(r.decode_tokens for r in run.requests) / seconds if seconds > 0 else math.nan


def end_to_end_rate(run: SideRun) -> float:
    return sum(len(r.token_ids) for r in run.requests) / run.seconds if run.seconds > 0 else math.nan


def spec_totals(requests: list[RequestRun]) -> dict:
    """Summed per-request speculation counters, with acceptance, tokens per verify step and the
    share of the output that verify steps emitted."""
    drafted = sum(r.spec.drafted for r in requests if r.spec is not None)
    accepted = sum(r.spec.accepted for r in requests if r.spec is not None)
    steps = sum(r.spec.verify_steps for r in requests if r.spec is not None)
    emitted = sum(r.spec.emitted for r in requests if r.spec is not None)
    out = sum(len(r.token_ids) for r in requests)
    return {"drafted": drafted, "accepted": accepted, "acceptance_rate": accepted / drafted if drafted else 0.0,
            "verify_steps": steps, "emitted": emitted, "tokens_per_verify_step": emitted / steps if steps else 0.0,
            "output_tokens": out, "emitted_share": emitted / out if out else 0.0}


def first_difference(x: list[int], y: list[int]) -> int | None:
    """The first index where two token lists differ (None when equal)."""
    if x == y:
        return None
    return next((k for k, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))


def compare_tokens(records: dict[str, list[SideRun]], names: list[str], decode=None) -> list[dict]:
    """Per prompt: are its greedy tokens the same on both sides and in every run (warm-up included)?"""
    rows = []
    for p, name in enumerate(names):
        seqs = {s: [run.requests[p].token_ids for run in records[s]] for s in SIDES}
        off, on = seqs["off"][-1], seqs["on"][-1]
        det = {s: all(t == seqs[s][0] for t in seqs[s]) for s in SIDES}
        same = det["off"] and det["on"] and off == on
        row = {"prompt": name, "same": same, "off_deterministic": det["off"], "on_deterministic": det["on"],
               "tokens": len(off)}
        if not same:
            i = first_difference(off, on)
            row.update(first_difference=i, off_tokens=len(off), on_tokens=len(on))
            if i is None:         # the last runs agree: some other run differs
                bad = next(s for s in SIDES if not det[s])
                other = next(t for t in seqs[bad] if t != seqs[bad][0])
                i = row["first_difference"] = first_difference(seqs[bad][0], other)
                off, on = seqs[bad][0], other
                row["between"] = f"two {bad} runs"
            else:
                row["between"] = "off and on"
            if decode is not None:
                row["off_text"] = [decode([t]) for t in off[max(0, i - 4):i + 3]]
                row["on_text"] = [decode([t]) for t in on[max(0, i - 4):i + 3]]
        rows.append(row)
    return rows


def summarize(records: dict[str, list[SideRun]], names: list[str], together: bool, decode=None) -> dict:
    """A part's report from its runs (index 0 of each side is the warm-up)."""
    timed = {s: records[s][1:] for s in SIDES}
    rate = {s: Stat() for s in SIDES}
    e2e = {s: Stat() for s in SIDES}
    ttft = {s: Stat() for s in SIDES}
    ratio = Stat()
    for k in range(len(timed["on"])):
        r = {s: side_rate(timed[s][k], together) for s in SIDES}
        for s in SIDES:
            rate[s].add(r[s])
            e2e[s].add(end_to_end_rate(timed[s][k]))
            for req in timed[s][k].requests:
                ttft[s].add(req.ttft * 1e3)
        ratio.add(r["on"] / r["off"])
    on_requests = [req for run in timed["on"] for req in run.requests]
    off_requests = [req for run in timed["off"] for req in run.requests]
    spec = spec_totals(on_requests)
    spec["engine"] = {k: sum(run.engine_spec.get(k, 0) for run in timed["on"]) for k in SPEC_KEYS}
    steps = {s: sum(req.decode_steps for run in timed[s] for req in run.requests) for s in SIDES}
    spec["decode_steps"] = steps
    spec["step_ratio"] = steps["on"] / steps["off"] if steps["off"] else math.nan
    off_drafted = (sum(req.spec.drafted for req in off_requests if req.spec is not None)
                   + sum(run.engine_spec.get("spec_drafted", 0) for run in timed["off"]))
    tokens = compare_tokens(records, names, decode)
    per_prompt = []
    for p, name in enumerate(names):
        st = {s: Stat([run.requests[p].decode_tok_s for run in timed[s]]) for s in SIDES}
        last = {s: timed[s][-1].requests[p] for s in SIDES}
        per_prompt.append({
            "prompt": name, "output_tokens": len(last["on"].token_ids), "finish_reason": last["on"].finish_reason,
            "decode_tok_s": {s: st[s].as_dict() for s in SIDES},
            "ratio_median": st["on"].median / st["off"].median,
            "ttft_ms": {s: Stat([run.requests[p].ttft * 1e3 for run in timed[s]]).as_dict() for s in SIDES},
            "cached_tokens": last["off"].cached_tokens, "same_tokens": tokens[p]["same"],
            "speculation": spec_totals([run.requests[p] for run in timed["on"]]),
            "text": last["off"].text[:400]})
    bounds = ({"low": min(rate["on"].values) / max(rate["off"].values),
               "high": max(rate["on"].values) / min(rate["off"].values)} if ratio.values else {})
    return {"prompts": list(names), "together": together, "runs": len(timed["on"]),
            "decode_tok_s": {s: rate[s].as_dict() for s in SIDES}, "ratio": ratio.as_dict(),
            "ratio_bounds": bounds, "end_to_end_tok_s": {s: e2e[s].as_dict() for s in SIDES},
            "ttft_ms": {s: ttft[s].as_dict() for s in SIDES}, "speculation": spec, "off_side_drafted": off_drafted,
            "identical": all(t["same"] for t in tokens), "same": sum(t["same"] for t in tokens),
            "total": len(tokens), "mismatches": [t for t in tokens if not t["same"]], "per_prompt": per_prompt,
            "_stats": (rate, ratio, ttft)}


# -- report --------------------------------------------------------------------------
def _ratio(st: Stat) -> str:
    v = st.values
    return f"{st.median:.2f}x [{min(v):.2f}–{max(v):.2f}]" if v else "-"


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%"


def print_report(res: dict, title: str) -> None:
    print(title)
    print("decode tok/s: tokens after the first / first-to-last token time; batch: aggregate while all streams "
          "decode. ratio = on/off per run.")
    print(f"{'part':<6}{'reqs':>5}{'off tok/s':>20}{'on tok/s':>20}{'on/off':>19}{'target':>11}{'same':>6}"
          f"{'drafted':>8}{'accepted':>9}{'acc':>5}{'verify':>7}{'tok/vs':>7}{'steps':>6}{'ttft ms off/on':>16}")
    for part, r in res.items():
        if "error" in r:
            print(f"{part:<6}  CRASHED: {r['error']}")
            continue
        rate, ratio, ttft = r["_stats"]
        sp = r["speculation"]
        target = TARGETS.get(part)
        mark = f">={target:.2f} {'ok' if ratio.median >= target else 'BELOW'}" if target else ""
        print(f"{part:<6}{len(r['prompts']):>5}{rate['off'].fmt():>20}{rate['on'].fmt():>20}"
              f"{_ratio(ratio):>19}{mark:>11}{str(r['same']) + '/' + str(r['total']):>6}"
              f"{sp['drafted']:>8}{sp['accepted']:>9}{_pct(sp['acceptance_rate']):>5}{sp['verify_steps']:>7}"
              f"{sp['tokens_per_verify_step']:>7.2f}{sp['step_ratio']:>6.2f}"
              f"{ttft['off'].median:>9.0f}/{ttft['on'].median:<6.0f}")
    print("(acc: accepted / drafted; tok/vs: output tokens per verify step; steps: decode steps on / off; "
          "counters summed over the timed runs)")
    for part, r in res.items():
        if "error" in r:
            continue
        print(f"\n{part}: per prompt, median of {r['runs']} runs"
              + (f"; aggregate end to end off {Stat(r['end_to_end_tok_s']['off'].get('runs', [])).fmt()} "
                 f"on {Stat(r['end_to_end_tok_s']['on'].get('runs', [])).fmt()} tok/s" if r["together"] else ""))
        for p in r["per_prompt"]:
            sp = p["speculation"]
            print(f"  {p['prompt']:<24}{p['output_tokens']:>5} tok ({p['finish_reason']})  off "
                  f"{p['decode_tok_s']['off'].get('median', math.nan):6.1f}  on "
                  f"{p['decode_tok_s']['on'].get('median', math.nan):6.1f}  {p['ratio_median']:5.2f}x  "
                  f"accept {_pct(sp['acceptance_rate']):>4} of {sp['drafted']:>5}  "
                  f"{sp['tokens_per_verify_step']:4.2f} tok/vs  {'same' if p['same_tokens'] else 'MISMATCH'}")
        for m in r["mismatches"]:
            print(f"  MISMATCH {part} {m['prompt']}: {m['between']} part at token {m['first_difference']}: "
                  f"{m.get('off_text', '')} vs {m.get('on_text', '')}")
        if r["off_side_drafted"]:
            print(f"  WARNING: requests with speculate=False drafted {r['off_side_drafted']} tokens")
        eng = r["speculation"]["engine"]
        if eng["spec_drafted"] != r["speculation"]["drafted"] or eng["spec_accepted"] != r["speculation"]["accepted"]:
            print(f"  WARNING: engine counters ({eng}) differ from the requests' own (drafted "
                  f"{r['speculation']['drafted']}, accepted {r['speculation']['accepted']})")


def _strip(obj):
    """The report without the in-memory Stat objects; NaN as null (strict JSON)."""
    if isinstance(obj, dict):
        return {str(k): _strip(v) for k, v in obj.items() if not str(k).startswith("_")}
    if isinstance(obj, (list, tuple)):
        return [_strip(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


def failures(res: dict) -> list[str]:
    """What fails the run under --strict: crashes, greedy tokens that differ, drafting where it was off."""
    out = []
    for part, r in res.items():
        if "error" in r:
            out.append(f"{part}: crashed ({r['error']})")
            continue
        out += [f"{part} {m['prompt']}: tokens differ ({m['between']}) at {m['first_difference']}"
                for m in r["mismatches"]]
        if r["off_side_drafted"]:
            out.append(f"{part}: speculate=False requests drafted {r['off_side_drafted']} tokens")
    return out


def parse_parts(text: str) -> list[str]:
    return common.parse_parts(text, PARTS)


def workloads(parts: list[str], prompts: int | None, streams: int) -> dict[str, list[Task]]:
    """The tasks of each part: the first ``prompts`` of edit and chat; batch cycles through
    those edit tasks to ``streams`` requests."""
    edit, chat = edit_tasks()[:prompts], chat_tasks()[:prompts]
    tasks = {"edit": edit, "chat": chat, "batch": [edit[i % len(edit)] for i in range(streams)]}
    return {p: tasks[p] for p in parts}


def _progress(part: str, runs: int):
    """A ``measure`` callback that prints each side's run on stderr (a CPU run takes a while)."""
    def show(i: int, side: str, run: SideRun) -> None:
        print(f"  {part} {f'run {i}/{runs}' if i else 'warm-up'} {side}: "
              f"{side_rate(run, part == 'batch'):.1f} decode tok/s, {run.seconds:.0f} s", file=sys.stderr)
    return show


def _check_args(a: argparse.Namespace) -> None:
    from lodestar.cli import CLIError
    for flag, v in (("--runs", a.runs), ("--max-tokens", a.max_tokens), ("--streams", a.streams)):
        if v < 1:
            raise CLIError(f"{flag} {v}: needs at least 1")
    if a.prompts is not None and a.prompts < 1:
        raise CLIError(f"--prompts {a.prompts}: needs at least 1")


def main(a: argparse.Namespace) -> int:
    from lodestar.cli import _engine, _load_draft, _spec_config
    from lodestar.engine.llm_engine import EngineConfig
    from lodestar.engine.loader import load_model, resolve_device
    from lodestar.formats.catalog import file_sha256
    parts = parse_parts(a.parts)
    _check_args(a)
    if a.spec is None:
        a.spec = "draft" if a.draft_model else "ngram"
    spec = _spec_config(a)
    if a.threads:
        torch.set_num_threads(a.threads)
    where = resolve_device(a.device)
    t_begin = time.perf_counter()
    loaded = load_model(a.model, mode=a.dtype, progress=False, device=a.device)
    draft = _load_draft(a, progress=False)
    tok = loaded.tokenizer
    tasks = workloads(parts, a.prompts, a.streams)
    ids = {p: [task_ids(tok, t) for t in ts] for p, ts in tasks.items()}
    block = 16
    batch_need = sum(len(x) + a.max_tokens + spec.num_spec_tokens + 2 * block for x in ids.get("batch", []))
    cfg = EngineConfig(max_num_seqs=max(16, a.streams), enable_prefix_cache=not a.no_prefix_cache, spec=spec,
                       kv_dir=a.kv_dir, block_size=block, kv_tokens=max(16384, batch_need))
    if a.ctx:
        cfg.max_model_len = a.ctx
        cfg.kv_tokens = max(cfg.kv_tokens, a.ctx)
    engine = _engine(loaded, cfg, draft)
    res: dict = {}
    for part in parts:
        print(f"measuring {part} ({len(ids[part])} prompts, {a.runs} runs + warm-up, off and on) ...", file=sys.stderr)
        t0 = time.perf_counter()
        try:
            records = measure(engine, ids[part], a.max_tokens, a.runs, together=part == "batch",
                              progress=_progress(part, a.runs))
        except Exception as e:  # noqa: BLE001 - a crash is a result: report it, keep the other parts
            traceback.print_exc()
            for rid in list(engine.requests):
                engine.abort(rid)
            res[part] = {"error": f"{type(e).__name__}: {e}", "part_seconds": time.perf_counter() - t0}
            continue
        res[part] = summarize(records, [t.name for t in tasks[part]], together=part == "batch",
                              decode=lambda t: tok.decode(t))
        res[part]["part_seconds"] = time.perf_counter() - t0
    wall = time.perf_counter() - t_begin
    spec_desc = (f"{spec.method}, up to {spec.num_spec_tokens} drafts"
                 + (f", n-gram {spec.ngram_min}..{spec.ngram_max}" if spec.method == "ngram" else
                    f", draft {draft.path.name}") + (", adaptive" if spec.adaptive else ""))
    print_report(res, f"\nspeculative decoding: {loaded.path.name} ({a.dtype}) on {where}, {torch.get_num_threads()} "
                      f"threads, spec {spec_desc}; greedy, max {a.max_tokens} new tokens, prefix cache "
                      f"{'on' if cfg.enable_prefix_cache else 'off'}; median [min–max] of "
                      f"{a.runs} runs after a warm-up")
    bad = failures(res)
    for f in bad:
        print(f"FAIL {f}")
    print(f"({wall:.0f} s in all)")
    if a.json:
        doc = {"bench": "spec", "model": loaded.path.name,
               "model_sha256": file_sha256(loaded.path) if loaded.path.is_file() else None,
               "dtype": a.dtype, "lodestar_device": where, "threads": torch.get_num_threads(), "runs": a.runs,
               "commit": git_commit(), "device": device_info(), "torch": torch.__version__,
               "sampler": {"temperature": 0.0, "kind": "greedy", "ignore_eos": False},
               "max_tokens": a.max_tokens, "streams": a.streams, "prefix_cache": cfg.enable_prefix_cache,
               "spec": dataclasses.asdict(spec),
               "draft": ({"model": draft.path.name, "dtype": draft.mode,
                          "sha256": file_sha256(draft.path) if draft.path.is_file() else None}
                         if draft is not None else None),
               "prompts": {p: [{"name": t.name, "tokens": len(x), "ids_sha": ids_hash(x)}
                               for t, x in zip(tasks[p], ids[p])] for p in parts},
               "config": {k: (str(v) if k == "json" else v) for k, v in vars(a).items() if k != "func"},
               "wall_seconds": wall, "failures": bad, "parts": _strip(res)}
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(doc, indent=1) + "\n")
    return 1 if bad and a.strict else 0
