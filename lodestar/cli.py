"""Command line: ``lodestar generate | chat | serve | models | bench``."""
from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from pathlib import Path

EXIT_USAGE = 2


class CLIError(Exception):
    """A user-facing error: printed as one line, exit code 2."""


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", "-m", default="default",
                   help="GGUF file path, Hugging Face folder (config.json + *.safetensors) or known model "
                        "(default, smollm2-135m, gemma3-270m)")
    p.add_argument("--dtype", default="packed", choices=["packed", "fp32", "bf16"],
                   help="packed: keep quantized blocks packed (fast, small); fp32/bf16: dequantize at load")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="where the model runs (auto: cuda when a GPU is visible, else cpu)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's choice)")
    p.add_argument("--ctx", type=int, default=None, help="context length cap (default: the model's, max 16384)")
    p.add_argument("--kv-dir", default=None,
                   help="disk KV tier folder: computed prefixes persist here and are reused after a restart")
    p.add_argument("--no-prefix-cache", action="store_true", help="recompute every prompt from scratch")
    p.add_argument("--tensor-parallel", "--tp", type=int, default=1, metavar="N",
                   help="split the model over N processes (one GPU each on CUDA, gloo on the CPU; default 1)")
    p.add_argument("--tp-timeout", type=float, default=120.0, metavar="SECONDS",
                   help="with --tensor-parallel: how long a rank waits for the others before the engine "
                        "stops with an error (default 120)")


def _add_spec_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("speculative decoding")
    g.add_argument("--spec", choices=["ngram", "draft"], default=None,
                   help="draft tokens and verify them in one step: ngram (prompt lookup over the request's own "
                        "tokens) or draft (a smaller model, --draft-model); same output, fewer steps")
    g.add_argument("--num-spec-tokens", type=int, default=16, metavar="N",
                   help="most draft tokens per verify step (default 16; adaptive below that)")
    g.add_argument("--draft-model", default=None, metavar="PATH|NAME",
                   help="with --spec draft: the draft model (same vocabulary as --model)")
    g.add_argument("--draft-dtype", default=None, choices=["packed", "fp32", "bf16"],
                   help="the draft model's --dtype (default: packed)")
    g.add_argument("--spec-ngram", type=int, nargs=2, default=[2, 5], metavar=("MIN", "MAX"),
                   help="with --spec ngram: n-gram lengths to match, longest first (default 2 5)")


def _spec_config(a: argparse.Namespace):
    """The SpecConfig of --spec/--num-spec-tokens/--spec-ngram (None without --spec); a bad value is a
    CLIError naming its flag, raised before any model loads."""
    from lodestar.engine.spec import MAX_SPEC_TOKENS, SpecConfig
    spec = getattr(a, "spec", None)
    if not 1 <= a.num_spec_tokens <= MAX_SPEC_TOKENS:
        raise CLIError(f"--num-spec-tokens {a.num_spec_tokens}: must be in [1, {MAX_SPEC_TOKENS}]")
    lo, hi = a.spec_ngram
    if not 1 <= lo <= hi <= 64:
        raise CLIError(f"--spec-ngram {lo} {hi}: needs 1 <= MIN <= MAX <= 64")
    if spec == "draft" and getattr(a, "tensor_parallel", 1) > 1:
        raise CLIError("--spec draft does not work with --tensor-parallel yet")
    if spec is None:
        if getattr(a, "draft_model", None):
            raise CLIError("--draft-model needs --spec draft")
        return None
    if spec == "draft" and not a.draft_model:
        raise CLIError("--spec draft needs --draft-model PATH|NAME (a model with the same vocabulary)")
    if spec == "ngram" and a.draft_model:
        raise CLIError("--draft-model is for --spec draft; --spec ngram drafts from the request's own tokens")
    try:
        return SpecConfig(method=spec, num_spec_tokens=a.num_spec_tokens, ngram_min=a.spec_ngram[0],
                          ngram_max=a.spec_ngram[1])
    except ValueError as e:
        raise CLIError(f"--spec: {e}") from None


def _load_draft(a: argparse.Namespace, progress: bool):
    """The --draft-model of ``--spec draft`` on --device (None otherwise)."""
    from lodestar.engine.loader import load_model
    if getattr(a, "spec", None) != "draft":
        return None
    if a.tensor_parallel > 1:
        raise CLIError("--spec draft does not work with --tensor-parallel yet")
    return load_model(a.draft_model, mode=a.draft_dtype or "packed", progress=progress,
                      device=getattr(a, "device", "cpu"))


def _add_sampling_args(p: argparse.ArgumentParser, temperature: float) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--temperature", "--temp", type=float, default=temperature,
                   help=f"0 = greedy (default {temperature})")
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repeat-penalty", type=float, default=1.0)
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--max-tokens", "-n", type=int, default=256)
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-text")


def _sampling_params(a: argparse.Namespace):
    from lodestar.engine.sampling import SamplingParams
    try:
        return SamplingParams(temperature=a.temperature, top_k=a.top_k, top_p=a.top_p, min_p=a.min_p,
                              repetition_penalty=a.repeat_penalty, presence_penalty=a.presence_penalty,
                              frequency_penalty=a.frequency_penalty, seed=a.seed, stop=list(a.stop),
                              max_tokens=a.max_tokens, ignore_eos=a.ignore_eos)
    except ValueError as e:
        raise CLIError(str(e)) from None


def _load_engine(a: argparse.Namespace, progress: bool = True):
    import torch

    from lodestar.engine.llm_engine import EngineConfig
    if a.threads:
        torch.set_num_threads(a.threads)
    spec = _spec_config(a)
    loaded = _load_model(a, progress and sys.stderr.isatty())
    cfg = EngineConfig(kv_dir=a.kv_dir, enable_prefix_cache=not a.no_prefix_cache,
                       tensor_parallel=loaded.tensor_parallel, spec=spec)
    if a.ctx:
        cfg.max_model_len = a.ctx
        cfg.kv_tokens = max(cfg.kv_tokens, a.ctx)
    return _engine(loaded, cfg, _load_draft(a, progress and sys.stderr.isatty()))


def _load_model(a: argparse.Namespace, progress: bool):
    """The model of --model/--dtype/--device, split over --tensor-parallel processes."""
    from lodestar.engine.loader import load_model
    if a.tensor_parallel < 1:
        raise CLIError(f"--tensor-parallel {a.tensor_parallel}: needs at least 1")
    if a.tensor_parallel > 1 and a.kv_dir:
        raise CLIError("--kv-dir does not work with --tensor-parallel yet: each rank holds only a slice of the KV cache")
    return load_model(a.model, mode=a.dtype, progress=progress, device=getattr(a, "device", "cpu"),
                      tensor_parallel=a.tensor_parallel, tp_timeout_s=a.tp_timeout)


def _engine(loaded, cfg, draft=None):
    """An engine over ``loaded`` (and a draft model); a model whose engine cannot start stops
    its workers. A draft model the engine refuses (another vocabulary) is a CLIError."""
    from lodestar.engine.llm_engine import LLMEngine
    from lodestar.engine.spec.drafters import DraftModelError
    try:
        return LLMEngine(loaded, cfg, draft=draft)
    except DraftModelError as e:
        loaded.close()
        raise CLIError(str(e)) from None
    except BaseException:
        loaded.close()
        raise


def prompt_ids(engine, text: str, raw: bool, system: str | None) -> list[int]:
    """The prompt as token ids: through the chat template unless ``raw`` or the model has none."""
    import jinja2
    tok = engine.tokenizer
    if raw or not tok.has_chat_template:
        return tok.encode(text)
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
    try:
        return tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    except jinja2.TemplateError as e:
        raise CLIError(f"{engine.loaded.path}: its chat template failed ({' '.join(str(e).split())}); "
                       "use --raw to send the prompt as is") from None


# -- generate -------------------------------------------------------------------
def _add_grammar_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("structured output (one of)")
    x = g.add_mutually_exclusive_group()
    x.add_argument("--json-schema", metavar="FILE", default=None,
                   help="output one JSON value valid under the JSON schema in FILE")
    x.add_argument("--regex", metavar="R", default=None,
                   help="output text that the regular expression R matches whole")
    x.add_argument("--grammar", metavar="FILE", default=None,
                   help="output text of the grammar in FILE (Lark, as llguidance reads it, or llama.cpp GBNF)")
    x.add_argument("--choice", action="append", default=None, metavar="TEXT",
                   help="output exactly one of the choices (repeat: --choice yes --choice no)")
    g.add_argument("--no-jump-forward", action="store_true",
                   help="sample every token, also those the grammar forces (default: append them without a "
                        "forward pass each)")


def _grammar_spec(a: argparse.Namespace):
    """The GrammarSpec of --json-schema/--regex/--grammar/--choice (None without one); a file that
    cannot be read or a malformed spec is a CLIError naming the flag."""
    from lodestar.engine.grammar import GrammarSpec

    def read(flag: str, path: str) -> str:
        try:
            return Path(path).expanduser().read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise CLIError(f"{flag} {path}: cannot read it ({getattr(e, 'strerror', None) or e})") from None

    if getattr(a, "json_schema", None) is not None:
        spec = GrammarSpec("json_schema", read("--json-schema", a.json_schema), "--json-schema")
    elif getattr(a, "regex", None) is not None:
        spec = GrammarSpec("regex", a.regex, "--regex")
    elif getattr(a, "grammar", None) is not None:
        spec = GrammarSpec("grammar", read("--grammar", a.grammar), "--grammar")
    elif getattr(a, "choice", None):
        spec = GrammarSpec("choice", list(a.choice), "--choice")
    else:
        return None
    try:
        spec.source()               # syntax errors before the model loads
    except ValueError as e:         # GrammarError, or the library's own for a regex
        raise _grammar_error(e, spec.field) from None
    return spec


def _grammar_error(e: ValueError, flag: str) -> CLIError:
    reason = getattr(e, "reason", None) or str(e)
    return CLIError(f"{flag}: {' '.join(str(reason).split())}")


def cmd_generate(a: argparse.Namespace) -> int:
    from lodestar.engine.grammar import GrammarError
    text = a.prompt
    if text == "-":
        text = sys.stdin.read()
    params = _sampling_params(a)
    params.grammar = _grammar_spec(a)
    params.jump_forward = not a.no_jump_forward
    engine = _load_engine(a)
    if params.grammar is not None:
        try:
            engine.compile_grammar(params.grammar)     # against this model's vocabulary
        except GrammarError as e:
            engine.close()
            engine.loaded.close()
            raise _grammar_error(e, params.grammar.field) from None
    ids = prompt_ids(engine, text, a.raw, a.system)
    t0 = time.perf_counter()
    t_first = None
    n = forced = 0
    reason = spec = None
    try:
        for out in engine.stream(ids, params):
            if t_first is None:
                t_first = time.perf_counter()
            n += len(out.token_ids)
            forced = out.forced_tokens
            spec = out.speculation or spec
            if out.text:
                sys.stdout.write(out.text)
                sys.stdout.flush()
            reason = out.finish_reason
    except KeyboardInterrupt:
        reason = "abort"
    finally:
        engine.close()
        engine.loaded.close()
    t1 = time.perf_counter()
    sys.stdout.write("\n")
    sys.stdout.flush()
    if not a.quiet:
        prefill = (t_first - t0) if t_first else 0.0
        decode = t1 - (t_first or t1)
        print(f"[{engine.loaded.path.name} {engine.loaded.mode}] load {engine.loaded.load_seconds:.2f}s | "
              f"prompt {len(ids)} tok, {len(ids) / max(prefill, 1e-9):.1f} tok/s | "
              f"generated {n} tok, {max(n - 1, 0) / max(decode, 1e-9):.1f} tok/s"
              f"{f' ({forced} forced by the grammar)' if params.grammar is not None else ''}"
              f"{_spec_summary(spec)} | finish: {reason}", file=sys.stderr)
    return 0


def _spec_summary(spec) -> str:
    """The stats line's speculation part ('' for a request that did not speculate)."""
    if spec is None:
        return ""
    return (f" | spec: {spec.drafted} drafted, {spec.accepted} accepted ({spec.acceptance_rate:.0%}), "
            f"{spec.verify_steps} verify steps, {spec.tokens_per_step:.1f} tok/step")


# -- chat -----------------------------------------------------------------------
CHAT_HELP = """commands:
  /help          this help
  /reset         forget the conversation
  /system TEXT   set the system prompt (and reset)
  /quit          leave (Ctrl+D works too; Ctrl+C stops an answer)"""


class ChatSession:
    """Conversation state; renders the prompt with the model's template or a plain fallback."""

    def __init__(self, engine, system: str | None) -> None:
        self.engine = engine
        self.system = system
        self.messages: list[dict] = []

    def prompt_ids(self) -> list[int]:
        tok = self.engine.tokenizer
        msgs = ([{"role": "system", "content": self.system}] if self.system else []) + self.messages
        if tok.has_chat_template:
            return tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        text = "".join(f"{m['role'].capitalize()}: {m['content']}\n" for m in msgs)
        return tok.encode(text + "Assistant:")

    def extra_stops(self) -> list[str]:
        return [] if self.engine.tokenizer.has_chat_template else ["\nUser:"]


def cmd_chat(a: argparse.Namespace) -> int:
    params = _sampling_params(a)
    engine = _load_engine(a)
    session = ChatSession(engine, a.system)
    if not engine.tokenizer.has_chat_template:
        print(f"note: {engine.loaded.path.name} has no chat template; using a plain 'User:/Assistant:' format",
              file=sys.stderr)
    print(f"lodestar chat — {engine.loaded.path.name} ({engine.loaded.mode}). /help for commands.", file=sys.stderr)
    from dataclasses import replace
    try:
        return _chat_loop(engine, session, params, replace)
    finally:
        engine.close()
        engine.loaded.close()


def _chat_loop(engine, session, params, replace) -> int:
    from lodestar.engine.llm_engine import ContextLengthError
    while True:
        try:
            line = input(">>> ")
        except EOFError:
            print(file=sys.stderr)
            return 0
        except KeyboardInterrupt:
            print("\n(/quit or Ctrl+D to leave)", file=sys.stderr)
            continue
        line = line.strip()
        if not line:
            continue
        if line.startswith("/"):
            cmd, _, arg = line.partition(" ")
            if cmd in ("/quit", "/exit"):
                return 0
            if cmd == "/help":
                print(CHAT_HELP, file=sys.stderr)
            elif cmd == "/reset":
                session.messages.clear()
                print("(conversation cleared)", file=sys.stderr)
            elif cmd == "/system":
                session.system = arg.strip() or None
                session.messages.clear()
                print(f"(system prompt {'set' if session.system else 'cleared'}; conversation cleared)",
                      file=sys.stderr)
            else:
                print(f"unknown command {cmd}; /help lists them", file=sys.stderr)
            continue
        session.messages.append({"role": "user", "content": line})
        try:
            ids = session.prompt_ids()
            p = replace(params, stop=list(params.stop) + session.extra_stops())
            reply, n, t0, t_first, reason = [], 0, time.perf_counter(), None, None
            try:
                for out in engine.stream(ids, p):
                    t_first = t_first or time.perf_counter()
                    n += len(out.token_ids)
                    reply.append(out.text)
                    sys.stdout.write(out.text)
                    sys.stdout.flush()
                    reason = out.finish_reason
            except KeyboardInterrupt:
                reason = "interrupted"
            t1 = time.perf_counter()
            sys.stdout.write("\n")
            session.messages.append({"role": "assistant", "content": "".join(reply)})
            rate = max(n - 1, 0) / max(t1 - (t_first or t1), 1e-9)
            cached = out.cached_tokens if n else 0
            print(f"[{n} tokens, {rate:.1f} tok/s, first token {((t_first or t1) - t0) * 1000:.0f} ms, "
                  f"prompt {len(ids)} tokens ({cached} cached)"
                  f"{', ' + reason if reason not in (None, 'stop') else ''}]", file=sys.stderr)
        except ContextLengthError as e:
            session.messages.pop()
            print(f"error: {e}; /reset to start over", file=sys.stderr)


# -- models ---------------------------------------------------------------------
def cmd_models(a: argparse.Namespace) -> int:
    from lodestar.cli_models import cmd_models as run
    return run(a)


# -- serve ----------------------------------------------------------------------
def _is_loopback(host: str) -> bool:
    import ipaddress
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _served_names(a: argparse.Namespace, path: Path) -> tuple[str, ...]:
    from lodestar.formats.catalog import ALIASES, KNOWN_MODELS
    if a.served_model_name:
        return tuple(dict.fromkeys(a.served_model_name))
    if a.model in ALIASES or a.model in KNOWN_MODELS:
        return tuple(dict.fromkeys([ALIASES.get(a.model, a.model), a.model]))
    return (path.stem,)


def _bind(host: str, port: int):
    import socket
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(2048)
    except OSError as e:
        raise CLIError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.setblocking(False)
    return sock


SAMPLING_KEYS = {"temperature": "general.sampling.temp", "top_p": "general.sampling.top_p",
                 "top_k": "general.sampling.top_k"}


def _metadata(loaded) -> dict:
    md = getattr(loaded.file, "metadata", None)
    return md if isinstance(md, dict) else {}


def sampling_defaults(a: argparse.Namespace, metadata: dict) -> dict:
    """What a request that leaves temperature/top_p/top_k out gets: the flag, else the model file's
    recommendation (``general.sampling.*``), else nothing (the API defaults); and serve's
    ``--max-tokens`` for requests that set no output cap."""
    out = {}
    for name, key in SAMPLING_KEYS.items():
        value = getattr(a, name, None)
        if value is None and isinstance(metadata.get(key), (int, float)) and not isinstance(metadata.get(key), bool):
            value = metadata[key]
        if value is not None:
            out[name] = int(value) if name == "top_k" else float(value)
    cap = getattr(a, "default_max_tokens", None)
    if cap is not None:
        out["max_tokens"] = cap
    from lodestar.engine.sampling import SamplingParams
    try:
        SamplingParams(**out)                 # the engine's own checks, at start rather than per request
    except ValueError as e:
        raise CLIError(f"sampling defaults {out}: {e}") from None
    return out


def _served_app(a: argparse.Namespace, spec, api_key: str | None):
    """The engine (on its own thread, warmed up) and the HTTP app over it, as `serve` runs them;
    the agent serves the same app in-process."""
    import torch

    from lodestar.engine.async_engine import AsyncLLMEngine
    from lodestar.engine.llm_engine import EngineConfig, LLMEngine
    from lodestar.serve import ServeConfig, build_app

    def build_engine(a: argparse.Namespace = a) -> LLMEngine:  # on the engine thread, which then owns all tensor work
        if a.threads:
            torch.set_num_threads(a.threads)
        cfg = EngineConfig(max_num_seqs=a.max_num_seqs, kv_dir=a.kv_dir, enable_prefix_cache=not a.no_prefix_cache,
                           tensor_parallel=a.tensor_parallel, spec=spec)
        if a.ctx:
            cfg.max_model_len = a.ctx
            cfg.kv_tokens = max(cfg.kv_tokens, a.ctx)
        engine = _engine(_load_model(a, sys.stderr.isatty()), cfg, _load_draft(a, sys.stderr.isatty()))
        try:
            engine.warmup()
        except BaseException:
            engine.close()
            engine.loaded.close()
            raise
        return engine

    if a.threads:
        torch.set_num_threads(a.threads)
    aeng = AsyncLLMEngine(build_engine, max_queued=a.max_queued)
    loaded = aeng.engine.loaded
    names = _served_names(a, loaded.path)
    config = ServeConfig(model_names=names, api_key=api_key, cors_origins=tuple(a.cors), keepalive_s=a.keepalive,
                         sampling_defaults=sampling_defaults(a, _metadata(loaded)), db_path=getattr(a, "db", None),
                         projects=tuple(getattr(a, "projects", None) or ()))
    app = build_app(aeng, config)
    if getattr(a, "bench_results", None) is not None:
        app.state.bench_results = a.bench_results
    _enable_switching(app, a, aeng, build_engine)
    return aeng, loaded, names, app


def _enable_switching(app, a: argparse.Namespace, aeng, build_engine) -> None:
    """Let POST /api/models/load serve another model, built with the same flags as the first."""
    import copy

    from lodestar.engine.async_engine import AsyncLLMEngine
    from lodestar.serve.web.models_api import EngineFactory, enable_model_switching, release_engine
    device = aeng.engine.loaded.device

    def build(model: str) -> AsyncLLMEngine:
        b = copy.copy(a)
        b.model = model
        return AsyncLLMEngine(lambda: build_engine(b), max_queued=a.max_queued)

    def release(engine) -> None:
        release_engine(engine)
        if device.startswith("cuda"):
            import torch
            torch.cuda.empty_cache()     # hand the old model's blocks back before the next one allocates

    def defaults(engine) -> dict:
        try:
            return sampling_defaults(a, _metadata(engine.engine.loaded))
        except CLIError:                 # the new file's recommendation is out of range: the flags alone
            return sampling_defaults(a, {})

    enable_model_switching(app, EngineFactory(build, mode=a.dtype, device=device, context=a.ctx,
                                              kv_tokens=aeng.engine.config.kv_tokens, sampling_defaults=defaults,
                                              release=release))


def _project_dirs(paths: list[Path] | None) -> tuple[Path, ...]:
    out = []
    for p in paths or ():
        if not p.expanduser().is_dir():
            raise CLIError(f"--projects {p}: not a folder")
        out.append(p.expanduser().resolve())
    return tuple(out)


def cmd_serve(a: argparse.Namespace) -> int:
    api_key = a.api_key or os.environ.get("LODESTAR_API_KEY") or None
    if not _is_loopback(a.host) and not api_key:
        raise CLIError(f"refusing to serve on non-loopback address {a.host} without --api-key "
                       "(or LODESTAR_API_KEY): anyone who can reach it could use the model")
    spec = _spec_config(a)        # bad speculation flags and a busy port fail before the model loads
    a.projects = _project_dirs(a.projects)
    if a.bench_results is not None and not a.bench_results.is_dir():
        raise CLIError(f"--bench-results {a.bench_results}: not a folder")
    sock = _bind(a.host, a.port)

    import uvicorn
    aeng, loaded, names, app = _served_app(a, spec, api_key)
    slot = app.state.serve.engine       # the served engine; POST /api/models/load replaces it
    host = f"[{a.host.strip('[]')}]" if ":" in a.host else a.host
    url = f"http://{host}:{sock.getsockname()[1]}"

    class Server(uvicorn.Server):
        async def startup(self, sockets=None) -> None:
            await super().startup(sockets)
            if self.started:
                tp = f", tensor-parallel {loaded.tensor_parallel}" if loaded.tensor_parallel > 1 else ""
                sd = f", spec {spec.method}" if spec is not None else ""
                print(f"lodestar: serving {names[0]} ({loaded.mode}{tp}{sd}, context {aeng.max_model_len}) at {url}  "
                      f"[OpenAI: {url}/v1, Anthropic: {url}/v1/messages]", flush=True)

        async def on_tick(self, counter: int) -> bool:
            # An engine that stopped (a tensor-parallel worker died, the model failed) serves no
            # one: its streams got the error already; stop instead of answering 503 forever.
            if slot.current is not None and slot.current.error is not None:
                return True
            return await super().on_tick(counter)

    import logging
    logging.getLogger("lodestar").setLevel(a.log_level.upper())
    server = Server(uvicorn.Config(app, log_level=a.log_level, access_log=a.log_level == "debug",
                                   timeout_graceful_shutdown=5))
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn re-raises the Ctrl+C it handled; the shutdown was clean
        pass
    finally:
        served = slot.current
        if served is not None:
            served.shutdown()
            served.engine.loaded.close()
        sock.close()
    error = served.error if served is not None else None
    if error is not None:
        from lodestar.engine.faults import ModelFaultError
        print(f"lodestar: error: engine stopped: {error}", file=sys.stderr)
        return EXIT_USAGE if isinstance(error, ModelFaultError) else 1
    return 0


# -- agent ----------------------------------------------------------------------
def _kv_identity(aeng) -> str | None:
    """What a session's KV checkpoint depends on: model file, weight mode, KV dtype and shapes,
    block size and context."""
    disk = getattr(aeng.engine, "disk", None)
    if disk is None:
        return None
    lay = disk.layout
    return f"{lay.model_sha256}:{lay.mode}:{lay.dtype}:b{lay.block_size}:ctx{aeng.max_model_len}"


def cmd_agent(a: argparse.Namespace) -> int:
    from lodestar.agent import app as agent_app
    from lodestar.agent.client import ChatClient
    try:
        if a.agent_command == "sessions":
            return agent_app.list_sessions(a)
        agent_app.check_args(a)
        run = agent_app.run_loop if a.agent_command == "loop" else agent_app.run_agent
        if a.base_url:
            client = ChatClient(a.base_url, a.served_model, agent_app.env_api_key(a))
            return run(a, agent_app.Connection(client, a.served_model or a.base_url, None))
        spec = _spec_config(a)
        if a.kv_dir is None:
            a.kv_dir = str(Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lodestar" / "kv")
        from lodestar.serve import LocalServer
        aeng, loaded, names, app = _served_app(a, spec, None)
        server = None
        try:
            server = LocalServer(app).start()
            client = ChatClient(server.base_url, names[0], transport=server.client_transport())
            return run(a, agent_app.Connection(client, names[0], _kv_identity(aeng), aeng.max_model_len))
        finally:
            if server is not None:
                server.stop()
            aeng.shutdown()           # checkpoints running conversations to the disk tier
            loaded.close()
    except agent_app.AgentUsageError as e:
        raise CLIError(str(e)) from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lodestar", description="Local LLM inference engine.")
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text from a prompt (text to stdout, stats to stderr)")
    g.add_argument("-p", "--prompt", required=True, help="prompt text ('-' reads stdin)")
    g.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    g.add_argument("--system", default=None, help="system prompt (chat template only)")
    g.add_argument("-q", "--quiet", action="store_true", help="no stats on stderr")
    _add_model_args(g)
    _add_sampling_args(g, temperature=0.0)
    _add_grammar_args(g)
    _add_spec_args(g)
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("chat", help="interactive multi-turn chat")
    c.add_argument("--system", default=None, help="system prompt")
    _add_model_args(c)
    _add_sampling_args(c, temperature=0.7)
    _add_spec_args(c)
    c.set_defaults(func=cmd_chat)

    m = sub.add_parser("models", help="list known, added and local models; add, verify or remove one")
    m.set_defaults(func=cmd_models, models_command=None)
    msub = m.add_subparsers(dest="models_command")
    ma = msub.add_parser("add", help="record a GGUF file or Hugging Face folder under a name (the files stay where "
                         "they are; their SHA-256 is taken now, for verify)")
    ma.add_argument("path", help="a .gguf file or a folder with config.json, *.safetensors and tokenizer.json")
    ma.add_argument("--name", default=None, help="the name to use with --model (default: the file stem or folder name)")
    mv = msub.add_parser("verify", help="check a model's files against a manifest, the hashes taken when it was "
                         "added, or a known model's published hash (exit 1 when one differs)")
    mv.add_argument("model", metavar="NAME|PATH")
    mv.add_argument("--manifest", type=Path, default=None, metavar="FILE",
                    help='JSON {"files": {"relative/path": {"sha256": ..., "size": ...}}}')
    mv.add_argument("--write-manifest", type=Path, default=None, metavar="FILE",
                    help="write the manifest of the files as they are now to FILE")
    mr = msub.add_parser("rm", help="forget an added model (its files are not touched)")
    mr.add_argument("name")

    s = sub.add_parser("serve", help="HTTP server speaking the OpenAI and Anthropic APIs")
    _add_model_args(s)
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; any other "
                   "than loopback needs --api-key)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--served-model-name", action="append", default=[], metavar="NAME",
                   help="model name clients use (repeatable: the first is the id, the rest aliases)")
    s.add_argument("--api-key", default=None, help="require this key (Bearer or x-api-key); also LODESTAR_API_KEY")
    s.add_argument("--cors", action="append", default=[], metavar="ORIGIN",
                   help="allow browser requests from ORIGIN (repeatable; '*' for any); off by default")
    s.add_argument("--max-queued", type=int, default=256, help="waiting requests before 503 (default 256)")
    s.add_argument("--max-num-seqs", type=int, default=16, help="sequences decoded together (default 16)")
    s.add_argument("--temperature", type=float, default=None,
                   help="temperature for requests that set none (default: the model file's general.sampling.temp, "
                        "else the API default 1.0); coding clients send none, and small models want a low one")
    s.add_argument("--top-p", type=float, default=None,
                   help="top-p for requests that set none (default: the model file's general.sampling.top_p, else 1.0)")
    s.add_argument("--top-k", type=int, default=None,
                   help="top-k for requests that set none (default: the model file's general.sampling.top_k, else off)")
    s.add_argument("--max-tokens", type=int, default=None, dest="default_max_tokens", metavar="N",
                   help="output cap for requests that set none (default: none, until the context ends); Codex "
                        "sends none, and a small model that loops would keep the server busy for minutes")
    s.add_argument("--keepalive", type=float, default=2.0,
                   help="seconds between SSE keep-alive comments while no token arrives (default 2)")
    s.add_argument("--db", type=Path, default=None,
                   help="the web app's store of conversations and agent sessions (default "
                        "~/.local/share/lodestar/agent.db, shared with lodestar agent)")
    s.add_argument("--projects", type=Path, nargs="+", default=[], metavar="DIR",
                   help="folders the web app's agent may work in (none: the agent routes answer 403)")
    s.add_argument("--bench-results", type=Path, default=None, metavar="DIR",
                   help="benchmark result JSONs that GET /report shows (default: the checkout's bench/results)")
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="server log level: info (default) logs requests the server changed and long prefills' "
                        "progress; debug adds one access line per request")
    _add_spec_args(s)
    s.set_defaults(func=cmd_serve)

    def agent_args(p: argparse.ArgumentParser) -> None:
        from lodestar.agent.args import add_agent_args
        _add_model_args(p)
        add_agent_args(p)
        _add_spec_args(p)
        p.set_defaults(func=cmd_agent, max_num_seqs=4, max_queued=64, served_model_name=[], cors=[],
                       keepalive=2.0, top_p=None, top_k=None)

    ag = sub.add_parser("agent", help="coding agent working in a project folder (interactive, -p PROMPT, "
                        "loop, sessions)")
    agent_args(ag)
    ag.add_argument("-p", "--prompt", default=None, help="run one prompt non-interactively and exit "
                    "('-' or a pipe reads stdin); risky calls need --allow rules")
    ag.add_argument("--resume", nargs="?", const="last", default=None, metavar="ID",
                    help="continue a stored session (default: the latest in this project)")
    ag.set_defaults(agent_command=None)
    agsub = ag.add_subparsers(dest="agent_command")
    al = agsub.add_parser("loop", help="loop runs: rounds with a fresh context each, carrying a validated "
                          "report, until done, blocked, failed or the limit")
    agent_args(al)
    al.add_argument("task", help="what to do")
    al.add_argument("--rounds", type=int, default=5, help="most rounds (default 5)")
    al.add_argument("--json", type=Path, default=None, help="write every round's report here")
    asess = agsub.add_parser("sessions", help="list stored sessions (most recent first)")
    asess.add_argument("--project", "-C", default=".", help="the project whose sessions to list (default .)")
    asess.add_argument("--all", action="store_true", help="every project's sessions")
    asess.add_argument("--limit", type=int, default=50)
    asess.add_argument("--db", type=Path, default=None, help="session store")
    asess.set_defaults(func=cmd_agent)

    from lodestar.cli_bench import add_bench_parser
    add_bench_parser(sub)
    return p


def user_errors() -> tuple[type[BaseException], ...]:
    """Exceptions the command line reports as one line with exit code 2."""
    from lodestar.distributed import ShardingError
    from lodestar.engine.faults import ModelFaultError
    from lodestar.engine.llm_engine import ContextLengthError
    from lodestar.engine.loader import DeviceError
    from lodestar.formats.catalog import ModelNotFoundError
    from lodestar.formats.gguf import GGUFError
    from lodestar.models import UnsupportedArchitectureError
    from lodestar.tokenizer import TokenizerError
    return (CLIError, ContextLengthError, DeviceError, ModelNotFoundError, GGUFError, UnsupportedArchitectureError,
            TokenizerError, ShardingError, ModelFaultError)


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # Importing torch makes some 300,000 objects that live as long as the process; collecting
    # while they are made would scan them again and again (0.2 s of the start), and frozen
    # afterwards no collection scans them at all.
    first = "torch" not in sys.modules
    from lodestar.engine.collector import paused
    with paused():
        parser = build_parser()
        a = parser.parse_args(argv)
        from lodestar.distributed import WorkerDiedError
    if first:
        gc.freeze()
    try:
        return a.func(a)
    except user_errors() as e:
        print(f"lodestar: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except WorkerDiedError as e:
        print(f"lodestar: error: {e}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
