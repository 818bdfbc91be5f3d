"""``KernelPolicy``: the GPU kernels' tuning switches parsed from the environment once, and the
policy in force (``active``, ``install``, ``using``). Runs on every machine (no kernel runs)."""
from __future__ import annotations

import pytest

from lodestar.kernels import policy as kp
from lodestar.kernels.policy import FUSIONS, MIB, KernelPolicy, active, install, using


@pytest.fixture(autouse=True)
def _keep_the_policy_in_force(monkeypatch):
    """Whatever a test installs is undone after it."""
    monkeypatch.setattr(kp, "_ACTIVE", kp._ACTIVE)


def test_defaults():
    pol = KernelPolicy.from_env({})
    assert pol == KernelPolicy()
    assert pol.fusions == frozenset(FUSIONS) and pol.pdl is True and pol.gemv_table == ""
    assert pol.weight_prefetch_bytes == 4 * MIB and pol.side_prefetch_bytes == 16 * MIB
    assert pol.gemv == "" and pol.dense_gemv is True and pol.prefill_attention == "paged"
    # an empty or blank value is the default
    blank = {s.env: " " for s in kp.SWITCHES}
    assert KernelPolicy.from_env(blank) == KernelPolicy.from_env({s.env: "" for s in kp.SWITCHES}) == pol
    # other variables are ignored
    assert KernelPolicy.from_env({"LODESTAR_GEMV": "16,16,1,4", "PATH": "/bin"}) == pol


def test_fuse_switch():
    fuse = lambda text: KernelPolicy.from_env({"LODESTAR_FUSE": text}).fusions  # noqa: E731
    assert fuse("1") == fuse("default") == frozenset(FUSIONS)
    assert fuse("0") == frozenset()
    assert fuse("split_sum, residual") == {"split_sum", "residual"}
    assert fuse("qkv_rope,") == {"qkv_rope"}
    with pytest.raises(ValueError, match="LODESTAR_FUSE names norm; use 1, 0 or a comma list of quant, split_sum"):
        fuse("quant,norm")
    for gone in ("quant_norm", "attn_rope", "attn_reduce"):       # fusions that were removed
        with pytest.raises(ValueError, match=f"LODESTAR_FUSE names {gone}"):
            fuse(gone)


def test_pdl_switch():
    pdl = lambda text: KernelPolicy.from_env({"LODESTAR_PDL": text}).pdl  # noqa: E731
    assert pdl("1") is True and pdl("0") is False
    for bad in ("2", "wait", "yes"):
        with pytest.raises(ValueError, match=f"LODESTAR_PDL='{bad}'; use 0 or 1"):
            pdl(bad)


def test_gemv_table_switch():
    table = lambda text: KernelPolicy.from_env({"LODESTAR_GEMV_TABLE": text}).gemv_table  # noqa: E731
    assert table("off") == "off"
    assert table(" /tmp/gemv.json ") == "/tmp/gemv.json"


@pytest.mark.parametrize("var,field", [("LODESTAR_WEIGHT_PREFETCH", "weight_prefetch_bytes"),
                                       ("LODESTAR_SIDE_PREFETCH", "side_prefetch_bytes")])
def test_prefetch_switches_read_mib(var, field):
    """Both weight prefetches read their size in MiB (fractions allowed, 0 off); a negative or
    non-numeric value is an error naming the switch."""
    size = lambda text: getattr(KernelPolicy.from_env({var: text}), field)  # noqa: E731
    assert size("1.5") == 3 << 19
    assert size("0") == 0
    assert size("64") == 64 << 20
    for bad in ("-1", "x", "lots"):
        with pytest.raises(ValueError, match=var):
            size(bad)


def test_policies_built_directly_are_checked():
    with pytest.raises(ValueError, match="unknown fusions norm"):
        KernelPolicy(fusions=frozenset({"quant", "norm"}))
    with pytest.raises(ValueError, match="prefetch sizes"):
        KernelPolicy(weight_prefetch_bytes=-1)
    with pytest.raises(ValueError, match="prefill_attention"):
        KernelPolicy(prefill_attention="flash")
    assert KernelPolicy().with_fusions(["quant"]).fusions == {"quant"}
    assert KernelPolicy().with_fusions(["quant"]).pdl is True


def test_active_reads_the_environment_once(monkeypatch):
    monkeypatch.setattr(kp, "_ACTIVE", None)
    monkeypatch.setenv("LODESTAR_PDL", "0")
    first = active()
    assert first.pdl is False
    monkeypatch.setenv("LODESTAR_PDL", "1")
    assert active() is first                      # read once, on first use


def test_using_restores_the_previous_policy():
    base = install(KernelPolicy(pdl=False))
    assert active() is base
    inner = KernelPolicy(fusions=frozenset())
    with using(inner) as got:
        assert got is inner and active() is inner
        with using(KernelPolicy()):
            assert active() == KernelPolicy()
        assert active() is inner
    assert active() is base
    with pytest.raises(RuntimeError):
        with using(inner):
            raise RuntimeError("boom")
    assert active() is base                       # restored after an exception too
