"""The split of a layer's VRAM misses between the link and the CPU (engine/cpu_share.py) on hand-made cases, beside the
original Strata's rule, and `--tune cpu_share`'s parser."""
from __future__ import annotations

import argparse

import pytest

from engine import cpu_share as cs

MB = 1e6
QWEN = 2.654208 * MB        # a Qwen3-30B-A3B Q4_K expert


def test_a_slow_cpu_gets_nothing():
    # link 50 GB/s: 53 us an expert; CPU 1 GB/s: 2.65 ms an expert
    sp = cs.split_layer(range(8), (), QWEN, cs.Rates(50, 1))
    assert sp.cpu == () and len(sp.link) == 8
    assert sp.us == pytest.approx(8 * QWEN / 50e3)
    # the original rule sends 45% of the misses to that CPU anyway, and the layer takes 4 experts' CPU time
    assert cs.original_link_share(50) == pytest.approx(0.55)
    n_cpu = round(8 * (1 - cs.original_link_share(50)))
    assert max(cs.layer_times(8, n_cpu, QWEN, cs.Rates(50, 1))) > 20 * sp.us


def test_comparable_rates_share():
    # gpu(c) = (8 - c) * 53.08, cpu(c) = 30 + c * 66.36 (40 GB/s): c = 3 gives max(265.4, 229.1); c = 4 gives 295.4
    sp = cs.split_layer(range(8), (), QWEN, cs.Rates(50, 40))
    assert len(sp.cpu) == 3 and sp.cpu == (5, 6, 7) and sp.link == (0, 1, 2, 3, 4)
    assert sp.gpu_us == pytest.approx(5 * QWEN / 50e3) and sp.cpu_us == pytest.approx(30 + 3 * QWEN / 40e3)
    assert sp.us < 0.65 * 8 * QWEN / 50e3
    # without the fixed cost the share over the link is link / (link + cpu) = 0.556 of a large layer's misses: the
    # original rule's 0.55, which is that balance for a 41 GB/s CPU beside a 50 GB/s link
    big = cs.split_layer(range(900), (), QWEN, cs.Rates(50, 40, cpu_overhead_us=0))
    assert len(big.link) / 900 == pytest.approx(50 / 90, abs=2e-3)
    assert cs.original_link_share(50) == pytest.approx(50 / (50 + 40.9), abs=1e-3)


def test_a_slow_link_sends_nearly_everything_to_the_cpu():
    # link 2 GB/s: 1,327 us an expert; CPU 20 GB/s: 133 us. All 8 on the CPU: 30 + 1,062 = 1,092 us
    sp = cs.split_layer(range(8), (), QWEN, cs.Rates(2, 20))
    assert len(sp.cpu) == 8 and sp.us == pytest.approx(30 + 8 * QWEN / 20e3)
    # the original keeps 0.55 * 2 / 20 = 5.5% on the link: here 0 of 8 too
    assert round(8 * cs.original_link_share(2)) == 0


def test_the_fixed_cost_keeps_a_lone_small_miss_on_the_link():
    # 0.5 MB: 10 us over the link, 30 + 10 us on the CPU
    assert cs.split_layer([3], (), 0.5 * MB, cs.Rates(50, 50)).cpu == ()
    assert cs.split_layer([3], (), 0.5 * MB, cs.Rates(50, 100, cpu_overhead_us=2)).cpu == (3,)     # 2 + 5 < 10


def test_staged_experts_stay_where_they_are():
    sp = cs.split_layer([4, 9, 2, 7], [9, 7], QWEN, cs.Rates(50, 40))
    assert set(sp.cpu) | set(sp.link) == {4, 2} and not set(sp.cpu) & set(sp.link)
    assert cs.split_layer([4, 9], [4, 9], QWEN, cs.Rates(50, 40)) == cs.LayerSplit((), (), 0.0, 0.0)


def test_gpu_work_and_a_busy_link_shift_the_share():
    alone = cs.split_layer(range(8), (), QWEN, cs.Rates(50, 40))
    busy = cs.split_layer(range(8), (), QWEN, cs.Rates(50, 40), link_busy_us=200)
    assert len(busy.cpu) > len(alone.cpu)
    # with the prefetch the link runs beside 400 us of GPU work: the CPU need only keep the link under it
    over = cs.split_layer(range(8), (), QWEN, cs.Rates(50, 40), gpu_us=400, overlapped=True)
    assert over.us == pytest.approx(400) and over.cpu == (7,)       # max(400, 7 * 53.1 = 371.6, 30 + 66.4)


def test_ties_take_the_fewer_on_the_cpu():
    # one expert either way: 10 us on the link, 0 + 10 us on the CPU
    assert cs.split_layer([1], (), 0.5 * MB, cs.Rates(50, 50, cpu_overhead_us=0)).cpu == ()


def test_fixed_shares_and_off():
    r = cs.Rates(50, 1)
    assert len(cs.split_layer(range(8), (), QWEN, r, share=0.3).cpu) == 2       # 2.4 rounds to 2
    assert len(cs.split_layer(range(8), (), QWEN, r, share=0.5).cpu) == 4
    assert len(cs.split_layer(range(8), (), QWEN, r, share=1.0).cpu) == 8
    assert cs.split_layer(range(8), (), QWEN, cs.Rates(2, 20), share=0.0).cpu == ()


def test_no_cpu_rate_means_no_cpu():
    assert cs.split_layer(range(8), (), QWEN, cs.Rates(2, 0)).cpu == ()
    assert cs.split_layer(range(8), (), QWEN, cs.Rates(2, 0), share=0.5).cpu_us == float("inf")


def test_rates_are_checked():
    for bad in ((0, 10), (-1, 10), (50, -1)):
        with pytest.raises(ValueError):
            cs.Rates(*bad)


@pytest.mark.parametrize("text, want", [("auto", None), ("AUTO", None), ("off", 0.0), ("0", 0.0), ("0.3", 0.3),
                                        ("1", 1.0), (" 0.25 ", 0.25)])
def test_tune_values(text, want):
    assert cs.parse_cpu_share(text) == want


@pytest.mark.parametrize("text", ["on", "1.5", "-0.1", "nan", "", "half"])
def test_tune_values_refused_with_a_message(text):
    with pytest.raises(argparse.ArgumentTypeError, match="cpu_share takes auto, off or a share from 0 to 1"):
        cs.parse_cpu_share(text)


def test_the_tune_entry_fits_the_cuda_args_table():
    """engine/cuda/args.py TUNING maps a key to (parser raising argparse.ArgumentTypeError, help): CPU_SHARE_TUNE."""
    from engine.cuda import args
    parse, help_text = cs.CPU_SHARE_TUNE
    assert parse is cs.parse_cpu_share and help_text.startswith("auto|off|F")
    assert all(len(entry) == 2 and callable(entry[0]) for entry in args.TUNING.values())


# --- the rule from the worker's options (--tune cpu_share / cpu_gbps / link_gbps) --------------------------------

def _opts(*tune):
    from engine.cuda.args import CudaOptions, add_cuda_args
    p = argparse.ArgumentParser()
    add_cuda_args(p)
    return CudaOptions.from_args(p.parse_args([a for t in tune for a in ("--tune", t)]))


def test_tune_keys_reach_the_options():
    o = _opts("cpu_share=0.25", "cpu_gbps=25.5", "link_gbps=49", "cpu_threads=15")
    assert (o.cpu_share, o.cpu_gbps, o.link_gbps, o.cpu_threads) == (0.25, 25.5, 49.0, 15)
    d = _opts()
    assert (d.cpu_share, d.cpu_gbps, d.link_gbps, d.cpu_threads) == (None, None, None, None)
    assert _opts("cpu_share=off").cpu_share == 0.0 and _opts("cpu_share=auto").cpu_share is None


@pytest.mark.parametrize("tune,msg", [("cpu_share=2", "cpu_share takes auto, off or a share"),
                                      ("cpu_gbps=0", "a rate in GB/s"), ("link_gbps=fast", "a rate in GB/s"),
                                      ("cpu_threads=0", ">= 1")])
def test_bad_tune_values_say_what_is_wrong(tune, msg, capsys):
    with pytest.raises(SystemExit):
        _opts(tune)
    assert msg in capsys.readouterr().err


def test_the_rule_from_options():
    # auto with both rates: split_layer's choice (test_comparable_rates_share's case: 3 of 8 to a 40 GB/s CPU)
    r = cs.ShareRule.from_options(_opts("cpu_gbps=40"), pcie_gbps=50)
    assert r.share is None and r.rates == cs.Rates(50, 40)
    assert r.split(range(8), (), QWEN).cpu == (5, 6, 7)
    # link_gbps wins over the start's own measurement
    assert cs.ShareRule.from_options(_opts("cpu_gbps=40", "link_gbps=2"), pcie_gbps=50).rates.link_gbps == 2
    # a fixed share takes its rounded part whatever the rates; the staged ones never move
    sp = cs.ShareRule.from_options(_opts("cpu_share=0.5", "cpu_gbps=1"), pcie_gbps=50).split(range(6), (0, 1), QWEN)
    assert sp.cpu == (4, 5) and sp.link == (2, 3)
    # off, or no measured CPU rate, or auto without a link rate: the link takes everything
    for o, pcie, why in ((_opts("cpu_share=off", "cpu_gbps=40"), 50, "off"), (_opts(), 50, "no CPU expert rate"),
                         (_opts("cpu_share=0.5"), 50, "no CPU expert rate"), (_opts("cpu_gbps=40"), None, "link")):
        r = cs.ShareRule.from_options(o, pcie_gbps=pcie)
        assert why in r.why
        sp = r.split(range(8), (), QWEN)
        assert sp.cpu == () and len(sp.link) == 8


def test_typical_split():
    # a 40 GB/s CPU beside a 50 GB/s link, 8 routed, none in VRAM: test_comparable_rates_share's 3 of 8
    assert cs.typical_split(cs.Rates(50, 40), QWEN, 8, 0.0) == (3, 8)
    # 80% in VRAM: 2 misses, one each way: max(53.1, 30 + 66.4) = 96.4 us against 106.2 over the link alone
    assert cs.typical_split(cs.Rates(50, 40), QWEN, 8, 0.8) == (1, 2)
    assert cs.typical_split(cs.Rates(50, 1), QWEN, 8, 0.8) == (0, 2)
    assert cs.typical_split(cs.Rates(50, 40), QWEN, 8, 1.0) == (0, 0)
    with pytest.raises(ValueError, match="hit rate"):
        cs.typical_split(cs.Rates(50, 40), QWEN, 8, 1.5)
