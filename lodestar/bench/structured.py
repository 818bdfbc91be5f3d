"""``lodestar bench structured``: constrained decoding's validity, cost, jump-forward gain and exactness.

In-process engine, one model; each part runs on its own engine over that model:

- validity: every schema of ``structured_schemas.SCHEMAS`` at temperature 0 and at 0.8 with
  several seeds, plus forced tool calls over ``TOOLS`` (a Lark grammar that embeds the
  call's JSON schema, as a server builds for ``tool_choice: required``), batched through
  the engine. Every output is parsed and validated with jsonschema (formats checked).
- cost: decode tok/s of a constrained request vs the same unconstrained request, at batch
  1 and at batch 16, same prompts, same number of new tokens, greedy, jump-forward off (the
  cost of the masks alone). Decode tok/s excludes prefill: tokens after each request's first
  over the window in which every request decodes (``serve_load.decode_rate``). The
  constraint is a JSON object with one long free string (``minLength`` well past the token
  budget), so it never ends before ``max_tokens``; the unconstrained run ignores EOS.
- jump: ``KEY_HEAVY`` schemas at temperature 0, one request at a time: wall time to the
  complete object with jump-forward on vs off, forced-token share, and whether both give
  the same text.
- exact: a constrained request alone vs the same request in a batch of 8 (constrained and
  unconstrained, greedy and seeded-sampled neighbours): the same tokens, per weight mode.

Ratios are taken in one run against the named baseline (unconstrained; jump-forward off),
median [min–max] of ``--runs`` after one warm-up.
"""
from __future__ import annotations

import argparse
import datetime
import json
import re
import sys
import time
from dataclasses import dataclass, field

import torch

from lodestar.bench import common
from lodestar.bench.common import Stat, device_info, git_commit, ids_hash
from lodestar.bench.serve_load import decode_rate
from lodestar.bench.structured_schemas import (KEY_HEAVY, SCHEMAS, TOOLS, SchemaCase, tool_call_grammar,
                                               tool_call_schema, tool_prompt)

PARTS = ("validity", "cost", "jump", "exact")
TARGETS = {"cost_b1": 0.95, "cost_b16": 0.90, "jump": 1.3}
STORY_TOPICS = ["a lighthouse keeper", "a lost robot", "the first city on Mars", "a dragon who bakes bread",
                "an old clock", "a river that flows uphill", "a chess tournament", "a haunted library",
                "a detective cat", "the last tree on Earth", "a submarine crew", "a village of inventors",
                "a talking violin", "a storm chaser", "a time-travelling postman", "a mountain monastery"]
TOOL_CALL = re.compile(r"\A<tool_call>\n(.*)\n</tool_call>\Z", re.DOTALL)


# -- running requests --------------------------------------------------------------
@dataclass
class Run:
    """One request's output and when its tokens arrived."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    forced: int = 0
    arrivals: list[tuple[float, int]] = field(default_factory=list)   # (time, tokens that step)
    forced_at: list[bool] = field(default_factory=list)   # per token: appended by jump-forward
    t_start: float = 0.0
    t_end: float = 0.0

    @property
    def seconds(self) -> float:
        return self.t_end - self.t_start


def drive(engine, prompts: list[list[int]], params: list) -> list[Run]:
    """Add all requests, step the engine until they finish; results in prompt order."""
    def record(r: Run, o, now: float) -> None:
        if o.token_ids:
            r.token_ids += o.token_ids
            r.forced_at += [False] + [True] * (len(o.token_ids) - 1)   # a step samples one, forces the rest
            r.arrivals.append((now, len(o.token_ids)))
        r.text += o.text
        r.forced = o.forced_tokens
        if o.finished:
            r.finish_reason, r.t_end = o.finish_reason, now
    return common.drive(engine, prompts, params, lambda t0: Run(t_start=t0), record)


def chat_ids(tokenizer, messages: list[dict] | str) -> list[int]:
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    if not tokenizer.has_chat_template:
        return tokenizer.encode("".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:")
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)


def make_engine(loaded, max_num_seqs: int, prefix_cache: bool):
    from lodestar.engine.llm_engine import EngineConfig, LLMEngine
    return LLMEngine(loaded, EngineConfig(max_num_seqs=max_num_seqs, enable_prefix_cache=prefix_cache))


def stat_delta(engine, before: dict, key: str) -> int:
    return engine.stats.get(key, 0) - before.get(key, 0)


# -- validity --------------------------------------------------------------------------
_TIME = r"([01]\d|2[0-3]):[0-5]\d:([0-5]\d|60)(\.\d+)?([Zz]|[+-]([01]\d|2[0-3]):[0-5]\d)"
_HOST_LABEL = r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"


def format_checker():
    """jsonschema's format checks plus the RFC 3339 times and RFC 1123 host names it checks only
    with optional packages installed."""
    import jsonschema
    fc = jsonschema.FormatChecker()

    @fc.checks("time")
    def _time(v) -> bool:
        return not isinstance(v, str) or re.fullmatch(_TIME, v) is not None

    @fc.checks("date-time")
    def _date_time(v) -> bool:
        if not isinstance(v, str):
            return True
        m = re.fullmatch(r"(\d{4}-\d{2}-\d{2})[Tt]" + _TIME, v)
        if m is None:
            return False
        try:
            datetime.date.fromisoformat(m.group(1))
        except ValueError:
            return False
        return True

    @fc.checks("hostname")
    def _hostname(v) -> bool:
        return not isinstance(v, str) or (len(v) <= 253 and re.fullmatch(rf"{_HOST_LABEL}(\.{_HOST_LABEL})*", v)
                                          is not None)
    return fc


def check_json(text: str, schema: dict, checker) -> tuple[str, str]:
    """("valid", "") or (category, reason): ``unparseable`` or ``invalid``."""
    import jsonschema
    try:
        value = json.loads(text)
    except ValueError as e:
        return "unparseable", str(e)
    errors = sorted(jsonschema.Draft202012Validator(schema, format_checker=checker).iter_errors(value),
                    key=lambda e: list(e.path))
    if errors:
        e = errors[0]
        return "invalid", f"{'/'.join(map(str, e.path)) or '<root>'}: {e.message}"
    return "valid", ""


def check_tool_call(text: str, checker) -> tuple[str, str]:
    """A forced call: the tags, then JSON of ``{"name", "arguments"}`` whose arguments fit that tool."""
    m = TOOL_CALL.match(text)
    if m is None:
        return "unparseable", "not <tool_call>\\n...\\n</tool_call>"
    kind, why = check_json(m.group(1), tool_call_schema(TOOLS), checker)
    if kind != "valid":
        return kind, why
    call = json.loads(m.group(1))
    tool = next(t for t in TOOLS if t.name == call["name"])
    return check_json(json.dumps(call["arguments"]), tool.parameters, checker)


def run_validity(loaded, a: argparse.Namespace) -> dict:
    from lodestar.engine.grammar import GrammarSpec
    from lodestar.engine.sampling import SamplingParams
    tok = loaded.tokenizer
    checker = format_checker()
    cases, prompts, params = [], [], []
    settings = [(0.0, 0)] + [(a.temperature, seed) for seed in range(1, a.seeds + 1)]
    for s in SCHEMAS[:a.schemas]:
        ids = chat_ids(tok, s.prompt)
        for temp, seed in settings:
            cases.append({"kind": "schema", "name": s.name, "temperature": temp, "seed": seed,
                          "prompt_ids_sha": ids_hash(ids)})
            prompts.append(ids)
            params.append(SamplingParams(temperature=temp, seed=seed, max_tokens=a.max_tokens,
                                         grammar=GrammarSpec("json_schema", s.schema)))
    tool_spec = GrammarSpec("grammar", tool_call_grammar(TOOLS, tok))
    for t in TOOLS[:a.tools]:
        ids = chat_ids(tok, tool_prompt(TOOLS, t.prompt))
        for temp, seed in settings[:1 + a.tool_seeds]:
            cases.append({"kind": "tool_call", "name": t.name, "temperature": temp, "seed": seed,
                          "prompt_ids_sha": ids_hash(ids)})
            prompts.append(ids)
            params.append(SamplingParams(temperature=temp, seed=seed, max_tokens=a.max_tokens, grammar=tool_spec))
    engine = make_engine(loaded, a.batch, prefix_cache=True)
    t0 = time.perf_counter()
    runs = drive(engine, prompts, params)
    seconds = time.perf_counter() - t0
    schemas = {s.name: s.schema for s in SCHEMAS}
    counts: dict[str, int] = {}
    failures = []
    for case, r in zip(cases, runs):
        if r.finish_reason == "length":
            kind, why = "truncated", f"max_tokens {a.max_tokens} reached"
        elif r.finish_reason != "stop":
            kind, why = "error", f"finish reason {r.finish_reason}"
        elif case["kind"] == "schema":
            kind, why = check_json(r.text, schemas[case["name"]], checker)
        else:
            kind, why = check_tool_call(r.text, checker)
        counts[kind] = counts.get(kind, 0) + 1
        case.update(result=kind, tokens=len(r.token_ids), forced=r.forced)
        if kind != "valid":
            case.update(reason=why, text=r.text)
            failures.append(case)
    total = len(cases)
    by_kind = {}
    for k in ("schema", "tool_call"):
        sel = [c for c in cases if c["kind"] == k]
        by_kind[k] = {"requests": len(sel), "valid": sum(c["result"] == "valid" for c in sel)}
    finished = total - counts.get("truncated", 0)
    return {"requests": total, "schemas": len(SCHEMAS[:a.schemas]), "tools": len(TOOLS[:a.tools]),
            "valid": counts.get("valid", 0), "valid_pct": 100.0 * counts.get("valid", 0) / max(total, 1),
            "finished": finished, "valid_of_finished_pct": 100.0 * counts.get("valid", 0) / max(finished, 1),
            "counts": counts, "by_kind": by_kind, "seconds": seconds, "batch": a.batch,
            "output_tokens": sum(len(r.token_ids) for r in runs), "forced_tokens": sum(r.forced for r in runs),
            "max_tokens": a.max_tokens, "sampler": {"temperatures": [0.0, a.temperature], "jump_forward": True},
            "failures": failures, "cases": cases}


# -- cost ---------------------------------------------------------------------------------
def story_schema(gen_tokens: int) -> dict:
    """One free string that cannot end within ``gen_tokens`` tokens (a token is at most a few
    dozen characters)."""
    return {"type": "object", "properties": {"story": {"type": "string", "minLength": 64 * gen_tokens}},
            "required": ["story"], "additionalProperties": False}


def run_cost(loaded, a: argparse.Namespace) -> dict:
    from lodestar.engine.grammar import GrammarSpec
    from lodestar.engine.sampling import SamplingParams
    tok = loaded.tokenizer
    spec = GrammarSpec("json_schema", story_schema(a.cost_tokens))
    prompts_all = [chat_ids(tok, f"Write a long story about {STORY_TOPICS[i % len(STORY_TOPICS)]}, as JSON with a "
                                 "'story' field.") for i in range(max(a.cost_batches))]
    modes = {"unconstrained": SamplingParams(temperature=0.0, max_tokens=a.cost_tokens, ignore_eos=True),
             "constrained": SamplingParams(temperature=0.0, max_tokens=a.cost_tokens, ignore_eos=True,
                                           grammar=spec, jump_forward=False)}
    engine = make_engine(loaded, max(a.cost_batches), prefix_cache=False)
    engine.compile_grammar(spec)
    out = {"grammar": spec.value, "gen_tokens": a.cost_tokens, "sampler": "greedy", "jump_forward": False,
           "prompt_ids_sha": [ids_hash(p) for p in prompts_all], "batches": {}}
    for b in a.cost_batches:
        prompts = prompts_all[:b]
        res = {m: Stat() for m in modes}
        ratio, mask_us, short = Stat(), Stat(), []
        for i in range(a.runs + 1):                  # run 0 is the warm-up
            rates = {}
            order = list(modes) if i % 2 == 0 else list(modes)[::-1]
            for m in order:
                before = dict(engine.stats)
                runs = drive(engine, prompts, [modes[m]] * b)
                rates[m] = decode_rate([r.arrivals for r in runs])
                short += [(m, len(r.token_ids)) for r in runs if len(r.token_ids) != a.cost_tokens]
                if m == "constrained" and i:
                    rows = stat_delta(engine, before, "grammar_mask_rows")
                    mask_us.add(stat_delta(engine, before, "grammar_mask_ns") / 1e3 / max(rows, 1))
            if i:
                for m in modes:
                    res[m].add(rates[m])
                ratio.add(rates["constrained"] / rates["unconstrained"])
        out["batches"][b] = {"decode_tok_s": {m: s.as_dict() for m, s in res.items()}, "ratio": ratio.as_dict(),
                             "mask_us_per_token": mask_us.as_dict(), "target": TARGETS["cost_b1" if b == 1 else
                                                                                      "cost_b16"],
                             "wrong_length": short, "_stats": (res, ratio, mask_us)}
    return out


# -- jump-forward ----------------------------------------------------------------------------
def run_jump(loaded, a: argparse.Namespace) -> dict:
    from lodestar.engine.grammar import GrammarSpec
    from lodestar.engine.sampling import SamplingParams
    tok = loaded.tokenizer
    checker = format_checker()
    cases: list[SchemaCase] = KEY_HEAVY[:a.jump_schemas]
    prompts = [chat_ids(tok, s.prompt) for s in cases]
    specs = [GrammarSpec("json_schema", s.schema) for s in cases]
    engine = make_engine(loaded, 1, prefix_cache=False)

    def params(spec, jf: bool) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=a.max_tokens, grammar=spec, jump_forward=jf)

    for spec in specs:
        engine.compile_grammar(spec)
    seconds = {True: Stat(), False: Stat()}
    per_schema = {s.name: {True: Stat(), False: Stat()} for s in cases}
    ratio = Stat()
    texts: dict[tuple[str, bool], set[str]] = {}
    last: dict[tuple[str, bool], Run] = {}
    for i in range(a.runs + 1):
        total = {True: 0.0, False: 0.0}
        for s, ids, spec in zip(cases, prompts, specs):
            for jf in ((True, False) if i % 2 == 0 else (False, True)):
                r = drive(engine, [ids], [params(spec, jf)])[0]
                texts.setdefault((s.name, jf), set()).add(r.text)
                last[(s.name, jf)] = r
                total[jf] += r.seconds
                if i:
                    per_schema[s.name][jf].add(r.seconds)
        if i:
            for jf in (True, False):
                seconds[jf].add(total[jf])
            ratio.add(total[False] / total[True])
    rows = {}
    differ = []
    for s in cases:
        on, off = last[(s.name, True)], last[(s.name, False)]
        same = texts[(s.name, True)] == texts[(s.name, False)] and len(texts[(s.name, True)]) == 1
        if not same:
            differ.append({"schema": s.name, "jump_forward": sorted(texts[(s.name, True)]),
                           "no_jump_forward": sorted(texts[(s.name, False)]),
                           **first_difference(on, off, loaded.tokenizer)})
        rows[s.name] = {"tokens": len(on.token_ids), "forced": on.forced,
                        "forced_share": on.forced / max(len(on.token_ids), 1),
                        "tokens_no_jf": len(off.token_ids), "same_text": same,
                        "same_tokens": on.token_ids == off.token_ids,
                        "valid": check_json(on.text, s.schema, checker)[0] if on.finish_reason == "stop"
                        else on.finish_reason,
                        "seconds": {"jump_forward": per_schema[s.name][True].as_dict(),
                                    "no_jump_forward": per_schema[s.name][False].as_dict()},
                        "ratio_median": per_schema[s.name][False].median / per_schema[s.name][True].median,
                        "prompt_ids_sha": ids_hash(prompts[cases.index(s)]), "text": on.text}
    tokens = sum(r["tokens"] for r in rows.values())
    forced = sum(r["forced"] for r in rows.values())
    return {"schemas": rows, "ratio": ratio.as_dict(), "target": TARGETS["jump"],
            "seconds": {"jump_forward": seconds[True].as_dict(), "no_jump_forward": seconds[False].as_dict()},
            "forced_share": forced / max(tokens, 1), "identical_text": not differ, "differences": differ,
            "sampler": "greedy", "max_tokens": a.max_tokens, "_stats": (ratio, seconds)}


def first_difference(a: Run, b: Run, tokenizer) -> dict:
    """Where two outputs' tokens part, and why: when neither token there was forced, both were
    sampled after the same ids, so the model scored them differently (numerics of the
    multi-token forward that feeds forced tokens vs one token per step); a forced token there
    means jump-forward tokenized the text otherwise than the model would have."""
    x, y = a.token_ids, b.token_ids
    i = next((k for k, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
    forced = (i < len(x) and a.forced_at[i]) or (i < len(y) and b.forced_at[i])
    return {"first_differing_token": i, "tokens": [tokenizer.decode([t]) for t in x[max(0, i - 3):i + 2]],
            "other_tokens": [tokenizer.decode([t]) for t in y[max(0, i - 3):i + 2]],
            "cause": "forced tokenization" if forced else "numerics (same ids, both sampled)"}


# -- exactness ----------------------------------------------------------------------------------
def run_exact(loaded_by_mode, a: argparse.Namespace) -> dict:
    """Per weight mode: each target request alone, then in a batch of 8 at another row position."""
    from lodestar.engine.grammar import GrammarSpec
    from lodestar.engine.sampling import SamplingParams
    out = {}
    n = a.exact_targets
    for mode, loaded in loaded_by_mode():
        tok = loaded.tokenizer
        engine = make_engine(loaded, 8, prefix_cache=False)
        checks = []
        for t in range(n):
            s = SCHEMAS[(t * 5) % len(SCHEMAS)]
            sampled = t == n - 1 and n > 1            # the last target is seeded sampling, the rest greedy
            target = SamplingParams(temperature=a.temperature if sampled else 0.0, seed=1000 + t,
                                    max_tokens=a.exact_tokens, grammar=GrammarSpec("json_schema", s.schema))
            ids = chat_ids(tok, s.prompt)
            alone = drive(engine, [ids], [target])[0]
            prompts, params = [], []
            for k in range(7):                      # neighbours: constrained / plain, greedy / sampled
                other = SCHEMAS[(t * 5 + 1 + k) % len(SCHEMAS)]
                grammar = GrammarSpec("json_schema", other.schema) if k % 2 == 0 else None
                temp = a.temperature if k % 3 == 1 else 0.0
                prompts.append(chat_ids(tok, other.prompt))
                params.append(SamplingParams(temperature=temp, seed=k, max_tokens=a.exact_tokens, grammar=grammar))
            pos = (3 * t + 2) % 8
            prompts.insert(pos, ids)
            params.insert(pos, target)
            batched = drive(engine, prompts, params)[pos]
            same = alone.token_ids == batched.token_ids
            first = next((i for i, (x, y) in enumerate(zip(alone.token_ids, batched.token_ids)) if x != y),
                         None if same else min(len(alone.token_ids), len(batched.token_ids)))
            checks.append({"schema": s.name, "temperature": target.temperature, "seed": target.seed,
                           "position": pos, "tokens": len(alone.token_ids), "same": same,
                           "first_difference": first, "prompt_ids_sha": ids_hash(ids),
                           **({} if same else {"alone": alone.text, "batched": batched.text})})
        jf_checks = []
        for s in KEY_HEAVY[:a.exact_jump]:              # jump-forward on vs off, greedy: same tokens?
            ids = chat_ids(tok, s.prompt)
            on, off = (drive(engine, [ids], [SamplingParams(temperature=0.0, max_tokens=a.max_tokens, jump_forward=jf,
                                                            grammar=GrammarSpec("json_schema", s.schema))])[0]
                       for jf in (True, False))
            same = on.token_ids == off.token_ids
            jf_checks.append({"schema": s.name, "tokens": len(on.token_ids), "forced": on.forced, "same": same,
                              **({} if same else first_difference(on, off, tok))})
        out[mode] = {"checks": checks, "same": sum(c["same"] for c in checks), "total": len(checks),
                     "jump_checks": jf_checks, "jump_same": sum(c["same"] for c in jf_checks)}
        del engine
    return {"modes": out}


# -- report ------------------------------------------------------------------------------------------
def _mark(value: float, target: float) -> str:
    return "ok" if value >= target else "BELOW"


def print_report(res: dict, title: str) -> None:
    print(title)
    v = res.get("validity")
    if v:
        print(f"\nvalidity: {v['valid']}/{v['requests']} valid ({v['valid_pct']:.1f}%), {v['schemas']} schemas at "
              f"T=0 and T={v['sampler']['temperatures'][1]} + {v['tools']} forced tool calls, batch {v['batch']}, "
              f"{v['seconds']:.0f} s")
        for k, c in v["by_kind"].items():
            print(f"  {k:<10} {c['valid']}/{c['requests']} valid")
        print(f"  of the {v['finished']} that finished (not cut off at max_tokens {v['max_tokens']}): {v['valid']} "
              f"valid ({v['valid_of_finished_pct']:.1f}%); outcomes: "
              + ", ".join(f"{k} {n}" for k, n in sorted(v["counts"].items())))
        for f in v["failures"]:
            print(f"  FAIL {f['kind']} {f['name']} T={f['temperature']} seed={f['seed']}: {f['result']} "
                  f"({f['reason']}): {f['text'][:200]!r}")
    c = res.get("cost")
    if c:
        print(f"\ncost: decode tok/s constrained (JSON, one free string, jump-forward off) vs unconstrained, "
              f"greedy, {c['gen_tokens']} new tokens")
        print(f"{'batch':>6}{'unconstrained':>24}{'constrained':>24}{'ratio':>22}{'target':>9}{'mask us/tok':>13}")
        for b, r in c["batches"].items():
            st, ratio, mask = r["_stats"]
            print(f"{b:>6}{st['unconstrained'].fmt():>24}{st['constrained'].fmt():>24}{ratio.fmt(3):>22}"
                  f"{'>=' + format(r['target'], '.2f'):>7} {_mark(ratio.median, r['target']):<5}"
                  f"{mask.median:>9.1f}")
            if r["wrong_length"]:
                print(f"  WARNING: outputs of another length than {c['gen_tokens']}: {r['wrong_length'][:8]}")
    j = res.get("jump")
    if j:
        ratio, seconds = j["_stats"]
        print("\njump: KEY_HEAVY schemas, greedy, time to the complete object, jump-forward on vs off "
              "(ratio = off / on)")
        print(f"{'schema':<24}{'tokens':>7}{'forced':>8}{'share':>7}{'on s':>9}{'off s':>9}{'ratio':>8}"
              f"{'same text':>11}{'valid':>8}")
        for name, r in j["schemas"].items():
            print(f"{name:<24}{r['tokens']:>7}{r['forced']:>8}{r['forced_share']:>7.0%}"
                  f"{r['seconds']['jump_forward']['median']:>9.3f}{r['seconds']['no_jump_forward']['median']:>9.3f}"
                  f"{r['ratio_median']:>7.2f}x{('yes' if r['same_text'] else 'NO'):>11}{r['valid']:>8}")
        print(f"{'all':<24}{'':>7}{'':>8}{j['forced_share']:>7.0%}{seconds[True].median:>9.3f}"
              f"{seconds[False].median:>9.3f}  ratio {ratio.fmt(2)} (target >= {j['target']:.1f}: "
              f"{_mark(ratio.median, j['target'])})")
        for d in j["differences"]:
            print(f"  DIFFERENT TEXT {d['schema']}: tokens part at {d['first_differing_token']}: on {d['tokens']} "
                  f"off {d['other_tokens']}; cause: {d['cause']}")
    e = res.get("exact")
    if e:
        print("\nexact: constrained request alone vs in a batch of 8 (mixed constrained/unconstrained neighbours)")
        for mode, r in e["modes"].items():
            print(f"  {mode:<7} {r['same']}/{r['total']} identical token sequences; jump-forward on vs off (KEY_HEAVY, "
                  f"greedy): {r['jump_same']}/{len(r['jump_checks'])} identical")
            for ch in r["checks"]:
                if not ch["same"]:
                    print(f"    DIFFER {ch['schema']} T={ch['temperature']} row {ch['position']}: first at token "
                          f"{ch['first_difference']}: alone {ch['alone'][:120]!r} batched {ch['batched'][:120]!r}")
            for ch in r["jump_checks"]:
                if not ch["same"]:
                    print(f"    DIFFER jump-forward {ch['schema']}: first at token {ch['first_differing_token']}: "
                          f"on {ch['tokens']} off {ch['other_tokens']}; cause: {ch['cause']}")


def _strip(obj):
    """The report without the in-memory Stat objects."""
    if isinstance(obj, dict):
        return {str(k): _strip(v) for k, v in obj.items() if not str(k).startswith("_")}
    if isinstance(obj, list):
        return [_strip(v) for v in obj]
    return obj


def parse_parts(text: str) -> list[str]:
    return common.parse_parts(text, PARTS)


def main(a: argparse.Namespace) -> int:
    from lodestar.engine.loader import load_model, resolve_device
    from lodestar.formats.catalog import file_sha256
    parts = parse_parts(a.parts)
    try:
        import jsonschema  # noqa: F401  (the dev extra: outputs are validated with it)
    except ImportError:
        print("lodestar bench structured validates outputs with jsonschema: pip install -e '.[dev]' "
              "(or pip install jsonschema)", file=sys.stderr)
        return 2
    if a.threads:
        torch.set_num_threads(a.threads)
    where = resolve_device(a.device)
    loaded = load_model(a.model, mode=a.dtype, progress=False, device=a.device)
    res: dict = {}
    for part in parts:
        print(f"measuring {part} ...", file=sys.stderr)
        t0 = time.perf_counter()
        if part == "validity":
            res[part] = run_validity(loaded, a)
        elif part == "cost":
            res[part] = run_cost(loaded, a)
        elif part == "jump":
            res[part] = run_jump(loaded, a)
        else:
            def by_mode():
                for mode in a.exact_modes:
                    yield mode, loaded if mode == a.dtype else load_model(a.model, mode=mode, progress=False,
                                                                          device=a.device)
            res[part] = run_exact(by_mode, a)
        res[part]["part_seconds"] = time.perf_counter() - t0
    name = loaded.path.name
    print_report(res, f"\nstructured output: {name} ({a.dtype}) on {where}, {torch.get_num_threads()} threads, "
                      f"median [min–max] of {a.runs} runs after a warm-up")
    if a.json:
        doc = {"bench": "structured", "model": name,
               "model_sha256": file_sha256(loaded.path) if loaded.path.is_file() else None,
               "dtype": a.dtype, "lodestar_device": where, "threads": torch.get_num_threads(), "runs": a.runs,
               "commit": git_commit(), "device": device_info(), "torch": torch.__version__,
               "config": {k: (str(v) if k == "json" else v) for k, v in vars(a).items() if k != "func"},
               "parts": _strip(res)}
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(doc, indent=1) + "\n")
    failed = (res.get("validity", {}).get("valid", 0) != res.get("validity", {}).get("requests", 0)
              or any(r["same"] != r["total"] for r in res.get("exact", {}).get("modes", {}).values())
              or not res.get("jump", {}).get("identical_text", True))
    return 1 if failed and a.strict else 0
