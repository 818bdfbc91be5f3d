"""Loading the default model packed must stay small (issue: < 400 MB added RSS)."""
import subprocess
import sys

LIMIT_MB = 400

SCRIPT = r"""
import resource, sys
def rss_mb():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
import torch
from lodestar.engine.loader import load_model
from lodestar.engine.llm_engine import LLMEngine, EngineConfig
from lodestar.engine.sampling import SamplingParams
base = rss_mb()
lm = load_model("default", mode="packed", progress=False)
loaded = rss_mb()
e = LLMEngine(lm, EngineConfig(kv_tokens=4096))
e.generate([lm.tokenizer.encode("Hello")], SamplingParams(temperature=0, max_tokens=8))
print(loaded - base, rss_mb() - base)
"""


def test_packed_default_model_adds_under_400_mb(smollm_path):
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    after_load, after_generate = map(float, out.stdout.split())
    assert after_load < LIMIT_MB, f"loading added {after_load:.0f} MB"
    assert after_generate < LIMIT_MB, f"loading + a short generation added {after_generate:.0f} MB"
