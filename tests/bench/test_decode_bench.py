"""`lodestar bench decode`: the two engines' runs interleave, and ratios pair run with run."""
from lodestar.bench.decode import measure, paired_ratios


class Fake:
    def __init__(self, name: str, log: list, speed: float) -> None:
        self.name, self.log, self.speed = name, log, speed

    def load(self) -> float:
        self.log.append((self.name, "load"))
        return 1.0 / self.speed

    def prefill(self, ids) -> float:
        self.log.append((self.name, "prefill"))
        return len(ids) / (100.0 * self.speed)

    def decode(self, ids, n) -> tuple[float, int]:
        self.log.append((self.name, "decode"))
        return n / (50.0 * self.speed), n


def test_runs_interleave_and_ratios_pair_them():
    log = []
    ours, peer = Fake("lodestar", log, 2.0), Fake("llama.cpp", log, 1.0)
    res = measure([ours, peer], {8: list(range(8))}, [1, 2], 16, runs=3)
    loads = [name for name, what in log if what == "load"]
    assert loads == ["lodestar", "llama.cpp", "llama.cpp", "lodestar", "lodestar", "llama.cpp"]
    assert res["lodestar"]["prefill_8_tok_s"].values == [200.0] * 3
    assert res["llama.cpp"]["decode_16_tok_s"].values == [50.0] * 3
    r = paired_ratios(res["lodestar"]["decode_16_tok_s"], res["llama.cpp"]["decode_16_tok_s"], "decode_16_tok_s")
    assert r.values == [2.0] * 3
    # load is time: llama.cpp's over lodestar's
    assert paired_ratios(res["lodestar"]["load_s"], res["llama.cpp"]["load_s"], "load_s").median == 2.0
