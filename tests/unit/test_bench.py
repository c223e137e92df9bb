"""tools/bench's statistics and its foreign-load monitor (issue #36: a benchmark that gives the
same answer twice says how far its repeats spread and whether other processes were running)."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "tools" / "bench"


def bench_module(name: str):
    """tools/bench/<name>.py, imported as the scripts import each other (their folder first on
    sys.path), under a private name so that no other test's `common` or `load` is shadowed."""
    sys.path.insert(0, str(BENCH))
    before = set(sys.modules)
    try:
        spec = importlib.util.spec_from_file_location(f"_bench_{name}", BENCH / f"{name}.py")
        mod = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    finally:
        sys.path.remove(str(BENCH))
        for plain in set(sys.modules) - before - {f"_bench_{name}"}:
            if (getattr(sys.modules[plain], "__file__", None) or "").startswith(str(BENCH)):
                del sys.modules[plain]  # `common` as report imports it: not for other tests


common, load, report, weight_sync_bench, routing_parts, compare = (
    bench_module(n) for n in ("common", "load", "report", "weight_sync_bench", "routing_parts",
                              "compare"))


def test_spread_reports_the_relative_spread_of_the_repeats():
    s = common.spread([1.0, 1.2, 0.9])
    assert (s["min"], s["median"], s["max"], s["n"]) == (0.9, 1.0, 1.2, 3)
    assert s["rel_spread"] == pytest.approx(0.3)
    assert math.isnan(common.spread([2.0])["rel_spread"])  # one repeat: no spread to report
    assert math.isnan(common.spread([None])["rel_spread"])
    # a repeat that never reached a reward (inf) is left out of the spread, not made inf of it
    assert common.spread([1.0, 1.1, float("inf")])["rel_spread"] == pytest.approx(0.1 / 1.1)


def test_a_weight_sync_repeat_is_the_median_of_its_rounds():
    # one wild round (a 2x slower sync: seen on a shared machine) moves no repeat's figure
    rounds = [0.7, 0.72, 0.35, 0.71, 0.69,  0.8, 0.78, 0.79, 0.81, 1.6]
    assert weight_sync_bench.per_repeat(rounds, 5) == [0.7, 0.8]
    table = "\n".join(report.detail_tables({"weight_sync": {"large": {
        "mb": 448.2, "tensors": 79, "buckets": 1, "rounds": 5,
        **{k: common.spread([0.7, 0.8]) for k in ("full_gbps", "raw_gbps", "efficiency",
                                                   "efficiency_flattened")}}}}))
    assert "| large | 448.2 | 79 | 1 | 0.7 / 0.75 / 0.8 |" in table
    assert "the median of its 5 back-to-back rounds" in table


def test_the_sync_bound_is_taken_step_by_step_not_from_a_sum_of_medians():
    """Each step is exactly 1% over its wait + train + weight sync, while the parts swap sizes
    from step to step (skewed, as on a loaded machine): the sum of their medians (2 + 2 + 1)
    says nothing of a step's (~1.0-10), the ratio step by step is 1.01 in both parts."""
    async_sync, longtail = bench_module("async_sync"), bench_module("longtail")
    parts = [(1.0, 9.0), (2.0, 1.0), (9.0, 2.0)] * 4  # (wait, train)
    rows = [{"perf/trainer_wait_s": w, "perf/train_time_s": t, "perf/weight_sync_s": 1.0,
             "perf/gen_time_s": w, "perf/step_time_s": 1.01 * (w + t + 1.0),
             "train/samples": 512, "rollout/reward_mean": 0.5, "broker/staleness_mean": 0.0}
            for w, t in parts]
    run = common.Run(rows=[rows[0]] * common.WARMUP_STEPS + rows, wall_s=10.0)
    median_of_step = common.statistics.median(r["perf/step_time_s"] for r in rows)
    assert median_of_step / (2.0 + 2.0 + 1.0) > 2  # what the medians' sum said
    assert longtail.sync_bound(run) == pytest.approx(1.01)
    # the async run: the same work, its train step 20% slower beside generation
    beside = common.Run(rows=[r | {"perf/train_time_s": 1.2 * r["perf/train_time_s"]}
                              for r in run.rows], wall_s=10.0)
    out = async_sync.summarize({0: [run, run], 1: [beside, beside]})
    assert out["staleness1"]["train_slowdown"]["median"] == pytest.approx(1.2)
    assert out["staleness1"]["gen_slowdown"]["median"] == pytest.approx(1.0)
    assert out["sync_bound_ratio"]["median"] == pytest.approx(1.01)
    assert out["sync_bound_ratio_compute"]["median"] == pytest.approx(1.01)
    # T, the trainer's own time (async_bound_ratio's max(G, T)): each step's, then the median
    own = [r["perf/step_time_s"] - r["perf/trainer_wait_s"] for r in rows]
    assert out["sync_components"]["T_s"]["median"] == pytest.approx(common.statistics.median(own))
    assert common.statistics.median(own) != pytest.approx(median_of_step - 2.0)


def test_proc_stat_lines_are_read_even_with_odd_command_names():
    # field 2 may hold spaces and parentheses; utime+stime+cutime+cstime = 100+50+30+20 ticks
    fields = ["S", "7"] + ["0"] * 9 + ["100", "50", "30", "20"] + ["0"] * 30
    ppid, cpu = load.parse_pid_stat("4242 (a) (b c) " + " ".join(fields))
    assert ppid == 7 and cpu == pytest.approx(200 / load.TICK)
    # user nice system idle iowait irq softirq steal: idle and iowait are not busy
    busy = load.machine_busy_s("cpu  100 10 20 1000 500 5 5 0 0 0\ncpu0 1 1 1 1 1 1 1 1 0 0\n")
    assert busy == pytest.approx(140 / load.TICK)


def test_the_tree_is_the_root_and_every_descendant():
    procs = {1: (0, 5.0), 10: (1, 1.0), 11: (10, 2.0), 12: (11, 4.0), 20: (1, 8.0)}
    assert load.tree_cpu_s(procs, 10) == 7.0
    assert load.tree_cpu_s(procs, 99) == 0.0
    before, after = (0.0, 10.0, 3.0), (2.0, 13.0, 4.0)  # (time, machine busy, tree)
    assert load.foreign_cores(before, after) == pytest.approx(1.0)  # 3 busy - 1 ours over 2 s
    assert load.foreign_cores(after, after) == 0.0
    assert load.foreign_cores(before, (2.0, 10.5, 4.0)) == 0.0  # sampling error: clipped


def test_a_loaded_summary_needs_a_mean_above_the_threshold():
    assert not load.summarize([])["loaded"]
    assert not load.summarize([load.LOADED_CORES, 0.0])["loaded"]
    assert load.summarize([1.0, 0.0])["loaded"]


BURN = ("import time\n"
        "t = time.process_time()\n"
        "while time.process_time() - t < {cpu}: pass\n")


@pytest.mark.skipif(not Path("/proc/stat").exists(), reason="reads /proc")
def test_our_children_count_as_ours_and_an_orphan_as_foreign(tmp_path):
    """Real processes: a child that burns 0.6 s of CPU (by its own clock, so however loaded
    the machine is) adds that to our tree once reaped; an orphan (double fork, re-parented
    away from us) burning as much adds it to the machine's busy time and not to ours. The
    bounds allow the clock-tick accounting of /proc (10 ms a tick, a few ticks per process)."""
    cpu = 0.6
    t0 = load.snapshot(os.getpid())
    subprocess.run([sys.executable, "-c", BURN.format(cpu=cpu)], check=True, timeout=120)
    t1 = load.snapshot(os.getpid())
    assert t1[2] - t0[2] >= cpu - 0.1, (t0, t1)

    done = tmp_path / "done"
    orphan = ("import os, sys\n"
              "if os.fork(): os._exit(0)\n"  # the child exits; the grandchild is re-parented
              + BURN.format(cpu=cpu) +
              f"open({str(done)!r}, 'w').write(str(time.process_time() - t))\n")
    t2 = load.snapshot(os.getpid())
    subprocess.run([sys.executable, "-c", orphan], check=True, timeout=120)
    deadline = time.monotonic() + 120
    while not (done.exists() and done.read_text()):
        assert time.monotonic() < deadline, "the orphan never finished burning"
        time.sleep(0.05)
    t3 = load.snapshot(os.getpid())
    foreign_s = (t3[1] - t2[1]) - (t3[2] - t2[2])
    assert foreign_s >= cpu - 0.1, (t2, t3)


def results(quick: bool, median: float, lo: float, hi: float, loaded: list[str]) -> dict:
    rec = {"min": lo, "median": median, "max": hi, "n": 3}
    return {"quick": quick, "loaded": loaded, "headline": {"async_bound_ratio": median},
            "async": {"staleness1": {"bound_ratio": rec}}}


def test_the_headline_table_shows_spread_load_and_quick_beside_full():
    full = results(False, 1.10, 1.0, 1.2, [])
    quick = results(True, 1.30, 1.2, 1.4, ["async"])
    lines = report.headline_table(full, quick)
    row = next(x for x in lines if x.startswith("| `async_bound_ratio`"))
    cells = [c.strip() for c in row.split("|")[1:-1]]
    # figure, definition, target, full (± half of max-min over the median), met, quick, met, agree
    assert cells[2] == "<= 1.05"
    assert cells[3] == "1.1 (±9%)" and cells[4] == "**no**"
    assert cells[5] == "1.3 (±8%) **loaded**"
    assert cells[7].startswith("**no**")  # 1.1 vs 1.3: more than 10% apart
    assert report.agreement(1.10, 1.05) == "yes" and report.agreement(1.0, None) == "-"
    # the same table from the quick run's side puts the full run first all the same
    assert report.headline_table(quick, full) == lines
    assert report.results_name(True) != report.results_name(False)


def test_the_page_leads_with_the_full_run_whichever_ran_last(tmp_path):
    """A `--quick --parts X` run after a full one rendered the page from its own side: its
    command first and its detail tables in place of the full run's (session 43)."""
    import json

    repo = BENCH.parents[1]
    full, quick = (json.loads((repo / report.results_name(q)).read_text()) for q in (False, True))
    doc = tmp_path / "benchmarks.md"
    page = report.markdown(quick, [], doc, full)
    assert page == report.markdown(full, [], doc, quick)
    assert f"Measured by `{full['command']}` (full:" in page
    assert f"Beside it, the quick run: `{quick['command']}`" in page


def test_each_part_is_probed_at_its_start_and_end_and_a_drift_is_marked():
    """A shared VM ran ~30% slower for minutes with nothing of its own running (session 41),
    which the load count cannot see: each part times a fixed piece of CPU work at its start
    and end, a part whose two probes differ by more than DRIFT is marked, and two runs that
    disagree say whether their machine's speed differed."""
    probes = iter([1.0, 1.05, 1.5, 1.5])
    with load.ForeignLoad(interval_s=0.05, probe=lambda: next(probes)) as mon:
        for name in ("async", "trl", "sync"):
            mon.part(name)
    parts = mon.parts()
    assert [parts[p]["probe_s"] for p in ("async", "trl", "sync")] == [
        [1.0, 1.05], [1.05, 1.5], [1.5, 1.5]]
    assert [parts[p]["drifted"] for p in ("async", "trl", "sync")] == [False, True, False]
    assert load.speed_probe(repeats=1) > 0.0  # the real probe runs
    # the table: a figure of a drifted part is marked as a loaded one is; a disagreement
    # names the machine's speed when the two runs' probes of its parts differ by over 10%
    full = results(False, 1.10, 1.0, 1.2, [])
    quick = results(True, 1.30, 1.2, 1.4, []) | {"drifted": ["async"]}
    full["load"] = {"async": {"probe_s": [0.10, 0.10]}}
    quick["load"] = {"async": {"probe_s": [0.12, 0.14]}}
    row = next(x for x in report.headline_table(full, quick)
               if x.startswith("| `async_bound_ratio`"))
    cells = [c.strip() for c in row.split("|")[1:-1]]
    assert cells[5].endswith("**drifted**") and "**drifted**" not in cells[3]
    assert cells[7] == "**no** (1.18; the quick run's machine 1.30x slower)"
    assert report.agreement(1.0, 1.3, machine=0.8) == (
        "**no** (1.3; the quick run's machine 1.25x faster)")
    assert report.agreement(1.0, 1.3, machine=1.05) == "**no** (1.3)"  # within DRIFT: no note
    assert report.machine_ratio(full, {}, "async_bound_ratio") is None
    note = report.load_note({"load": {"idle_check": {"available": True, "mean_cores": 0.0},
                                      "async": {"available": True, "samples": 3,
                                                "mean_cores": 0.0, "probe_s": [0.1, 0.2],
                                                "drifted": True}},
                             "drifted": ["async"]})
    assert "async 0.100 -> 0.200" in note and "**drifted** by more than 10%: async" in note


def test_the_sglang_part_reports_its_ratios_and_modes():
    """Part 10 (the real SGLang server): the ratios of repeat i's runs and a row per mode in
    the generated page, beside the hf engine's headlines."""
    run_py = bench_module("run")
    sglang = bench_module("sglang_bench")

    def run(samples_per_s: float, wait_s: float) -> object:
        row = {"perf/step_time_s": 512 / samples_per_s, "train/samples": 512,
               "perf/gen_time_s": 1.0, "perf/trainer_wait_s": wait_s,
               "perf/train_time_s": 0.1, "perf/weight_sync_s": 0.01, "rollout/reward_mean": 0.5}
        return common.Run(rows=[row] * 6, wall_s=10.0)
    res = {"sglang": sglang.summarize({"sync": [run(100, 1.1), run(100, 1.3)],
                                       "async": [run(150, 0.1), run(160, 0.1)],
                                       "colocated": [run(75, 1.2), run(80, 1.2)]})}
    sg = res["sglang"]
    assert sg["async_speedup"]["median"] == pytest.approx(1.55)  # 1.5 and 1.6, paired
    assert sg["async_over_colocated"]["median"] == pytest.approx(2.0)
    assert sg["rollout_overhead_ratio"]["median"] == pytest.approx(1.2)
    res["headline"] = run_py.headline(res)
    assert set(res["headline"]) == {"sglang_async_speedup", "sglang_async_over_colocate",
                                    "sglang_rollout_overhead_ratio"}
    page = "\n".join(report.headline_table(res) + report.detail_tables(res))
    assert "| `sglang_async_speedup` |" in page and "| colocated | " in page


def test_the_towers_part_reports_split_over_replicated():
    """Part 11 (megatron's towers at TP=2): split over replicated per repeat's pair, a row per
    mode in the generated page."""
    run_py = bench_module("run")
    towers = bench_module("towers_bench")

    def run(train_s: float, step_s: float) -> object:
        row = {"perf/step_time_s": step_s, "perf/train_time_s": train_s,
               "rollout/reward_mean": 0.3}
        return common.Run(rows=[row] * 6, wall_s=10.0)
    res = {"towers": towers.summarize({"replicated": [run(0.4, 1.0), run(0.5, 1.0)],
                                       "split": [run(0.3, 0.9), run(0.3, 0.8)]})}
    t = res["towers"]
    assert t["split_train_ratio"]["median"] == pytest.approx((0.75 + 0.6) / 2)
    assert t["split_step_ratio"]["median"] == pytest.approx(0.85)
    res["headline"] = run_py.headline(res)
    assert set(res["headline"]) == {"towers_split_train_ratio", "towers_split_step_ratio"}
    page = "\n".join(report.headline_table(res) + report.detail_tables(res))
    assert "| `towers_split_train_ratio` |" in page and "| split | " in page


@pytest.mark.skipif(not Path("/proc/stat").exists(), reason="reads /proc")
def test_run_refuses_to_start_while_other_processes_keep_the_machine_busy(tmp_path):
    """Two orphans spin (foreign to run.py whatever else runs: at least a quarter of a core
    each even on a loaded 2-core machine); run.py must refuse before measuring anything,
    naming the load and --allow-load."""
    pids = tmp_path / "pids"
    spin = ("import os, sys, time\n"
            "if os.fork(): os._exit(0)\n"
            f"open({str(pids)!r}, 'a').write(f'{{os.getpid()}}\\n')\n"
            "t = time.monotonic()\n"
            "while time.monotonic() - t < 120: pass\n")
    try:
        for _ in range(2):
            subprocess.run([sys.executable, "-c", spin], check=True, timeout=60)
        deadline = time.monotonic() + 60
        while not (pids.exists() and len(pids.read_text().split()) == 2):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        proc = subprocess.run([sys.executable, str(BENCH / "run.py"), "--quick", "--parts",
                               "broker", "--out", str(tmp_path / "out"), "--doc",
                               str(tmp_path / "doc.md")],
                              capture_output=True, text=True, timeout=120)
    finally:
        for pid in (pids.read_text().split() if pids.exists() else []):
            try:
                os.kill(int(pid), 9)
            except ProcessLookupError:
                pass
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "cores of" in proc.stderr and "--allow-load" in proc.stderr, proc.stderr
    assert not (tmp_path / "out").exists() and not (tmp_path / "doc.md").exists()


def test_the_routing_parts_baselines_compute_what_the_project_does():
    """tools/bench/routing_parts.py times R3's parts beside the way each rewritten part was done
    before: a baseline is only one if it gives the same ids, bit for bit, and the bench runs."""
    import numpy as np
    import torch

    from relax_slurm.config.algo import AlgoConfig
    from relax_slurm.routing.hooks import RoutingTrace
    from relax_slurm.routing.shape import (RoutingShape, decode_routed_experts,
                                           encode_routed_experts)
    from relax_slurm.samples import Sample
    from relax_slurm.trainer.batch import collate_routed, prepare_items

    trace = RoutingTrace(3)
    trace.calls = {layer: [torch.randint(0, 4, (3, w, 2), dtype=torch.int32) for w in (5, 1, 1)]
                   for layer in range(2)}
    lengths, pads = [6, 4, 7], [1, 3, 0]  # left-padded rows of a generate call
    for got, want in zip(trace.rows(2, lengths, pads),
                         routing_parts.rows_per_row(trace, 2, lengths, pads)):
        assert torch.equal(got, want)
    shape = RoutingShape(layers=2, topk=2, experts=4, moe_layers=(0, 1))
    ids = np.random.default_rng(0).integers(0, 4, (6, 2, 2))
    text = encode_routed_experts(ids)
    assert np.array_equal(decode_routed_experts(text, shape, 6),
                          routing_parts.decode_two_reductions(text, shape, 6))
    items = prepare_items([[Sample(prompt_id="p", group_id=0, prompt_ids=np.arange(1, 1 + p),
                                   response_ids=np.arange(2), loss_mask=np.ones(2),
                                   rollout_logprobs=-np.ones(2), reward=float(p % 2),
                                   routed_experts=np.arange((p + 1) * 4, dtype=np.int16))
                            for p in (2, 4, 3)]], AlgoConfig())
    assert torch.equal(collate_routed(items, 6), routing_parts.collate_per_sample(items, 6))
    res = routing_parts.measure(groups=2, samples_per_group=4, tokens=8, layers=2, topk=2,
                                experts=4, repeat=1)
    assert all(math.isfinite(v) for v in res.values())
    assert {k for k in res if not k.endswith("_before")} == {
        "engine_rows", "engine_base64", "worker_decode", "broker_put", "trainer_collate"}


def test_the_broker_part_puts_a_workers_groups_through_the_real_broker(tmp_path):
    """Part 5 as run.py runs it, shortened (4 groups of 3, 2 timed rounds): the real broker
    process accepts every put of groups made as a worker makes them (one stamp map per group,
    a version span per sample, restamped for each round's version) and the trainer's get_batch
    takes them; session 39's first bench run died here on spans left at the old version."""
    bb = bench_module("broker_bench")
    proc, router = bb.start_broker(bb.write_config(tmp_path, 4))
    try:
        r = bb.through_broker(router, bb.make_groups(4, 3), 2)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert r["samples_per_batch"] == 12 and len(r["get_batch_s"]) == 2
    assert all(t > 0 for t in r["get_batch_s"])


def test_the_broker_part_gives_the_bench_its_cores_back(tmp_path):
    """Part 5 pins its own process to core 1 while it measures; run.py starts the later parts'
    relax-train runs from that process, and an unpinned mode inherits its cores: left pinned,
    every later part ran on one core (the colocated long tail at half its speed)."""
    bb = bench_module("broker_bench")
    before = os.sched_getaffinity(0)
    r = bb.measure(tmp_path, 1, n_groups=2, n_samples=2)
    assert os.sched_getaffinity(0) == before
    assert len(r["broker"]["get_batch_s"]) == 1 and len(r["throughput_ratio"]) == 1


def test_a_missing_bench_extra_is_named_before_any_part_runs(monkeypatch, capsys):
    """TRL (part 3) and matplotlib (the plots) come from the bench extra; without them the
    bench used to run the parts before part 3 and then die in a CalledProcessError (session
    39 lost two async runs so). Now they are named, with the install command, at the start."""
    run_py = bench_module("run")
    present = importlib.util.find_spec
    monkeypatch.setattr(run_py.importlib.util, "find_spec",
                        lambda name, *a: None if name == "trl" else present(name, *a))
    assert run_py.missing_extras({"async", "trl"}) == ["trl"]
    assert run_py.missing_extras({"async", "longtail"}) == []
    for missing, hint in (("trl", True), ("matplotlib", False)):
        monkeypatch.setattr(run_py.importlib.util, "find_spec",
                            lambda name, *a, m=missing: None if name == m else object())
        monkeypatch.setattr(sys, "argv", ["run.py", "--parts", "async,trl"])
        with pytest.raises(SystemExit) as stop:
            run_py.main()
        assert stop.value.code == 2
        err = capsys.readouterr().err
        # leaving part 3 out is offered only where it helps (the plots need matplotlib always)
        assert f"{missing} cannot be imported" in err and ("leave part 3 out" in err) == hint


def rec(*repeats: float) -> dict:
    return common.spread(list(repeats))


def test_a_figure_regressed_only_when_every_repeat_moved_beyond_the_tolerance():
    judge = compare.judge
    base = rec(1.60, 1.66, 1.75)
    # every new repeat below every baseline one, the median 12% lower: higher is better
    assert judge("async_speedup", base, rec(1.40, 1.46, 1.52), True) == (
        pytest.approx(1.46 / 1.66 - 1), "regressed")
    assert judge("async_speedup", base, rec(1.80, 1.90, 1.95), True)[1] == "improved"
    # the same numbers for a figure where lower is better
    assert judge("async_bound_ratio", base, rec(1.40, 1.46, 1.52), False)[1] == "improved"
    assert judge("async_bound_ratio", base, rec(1.80, 1.90, 1.95), False)[1] == "regressed"
    # the median 12% lower but one repeat inside the baseline's range: the spread, not a loss
    assert judge("async_speedup", base, rec(1.40, 1.46, 1.62), True)[1] == "same"
    # every repeat lower, but by less than the tolerance (a drift between invocations)
    assert judge("async_speedup", rec(1.00, 1.01, 1.02), rec(0.97, 0.98, 0.99), True)[1] == "same"
    assert judge("async_speedup", rec(1.00, 1.01, 1.02), rec(0.97, 0.98, 0.99), True,
                 tolerance=0.01)[1] == "regressed"
    # a reward delta near 0 is judged in reward units, not relative to its median
    delta = judge("async_reward_delta", rec(0.001, 0.002, 0.004), rec(-0.09, -0.08, -0.06), True)
    assert delta == (pytest.approx(-0.082), "regressed")
    assert judge("async_reward_delta", rec(0.001, 0.002, 0.004), rec(-0.03, -0.02, -0.01),
                 True)[1] == "same"  # 0.022 lower: inside the target's 0.05 band
    # so is a share of the step, in step units: the overlapped sync's exposed ~7e-5 of a step
    # moved by 28% is 15 us, the timer's grain; broker_step_share 0.022 -> 0.031 is a loss
    assert judge("longtail_sync_share_overlap", rec(5.0e-5, 5.2e-5, 5.5e-5),
                 rec(6.7e-5, 6.7e-5, 6.8e-5), False) == (pytest.approx(1.5e-5), "same")
    assert judge("broker_step_share", rec(0.020, 0.022, 0.024), rec(0.030, 0.031, 0.033),
                 False)[1] == "regressed"
    # no verdict without two repeats a side, or with a repeat that never got there (inf)
    assert judge("async_speedup", rec(1.66), rec(1.2), True) == (
        pytest.approx(1.2 / 1.66 - 1), "one repeat")
    assert judge("trl_time_to_0.8_ratio", rec(1.5, 1.6, float("inf")), rec(1.0, 1.1, 1.2),
                 True)[1] == "one repeat"
    assert judge("async_speedup", {}, base, True) == (None, "missing")


def figures_at(**figures: dict) -> dict:
    """A bench result holding `figures` where report.py looks for them."""
    res: dict = {"quick": False, "headline": {k: v["median"] for k, v in figures.items()}}
    for key, value in figures.items():
        node = res
        *path, leaf = report._path(key)
        for p in path:
            node = node.setdefault(p, {})
        node[leaf] = value
    return res


def test_a_loaded_or_drifted_part_gets_no_verdict_and_other_parts_can_be_left_out():
    base = figures_at(async_speedup=rec(1.6, 1.66, 1.75),
                      weight_sync_efficiency=rec(0.8, 0.83, 0.85))
    new = figures_at(async_speedup=rec(1.2, 1.3, 1.4),
                     weight_sync_efficiency=rec(0.6, 0.62, 0.65))
    verdicts = {v.figure: v.verdict for v in compare.compare(base, new)}
    assert verdicts == {"async_speedup": "regressed", "weight_sync_efficiency": "regressed"}
    # a drift inside a part is judged, marked: it fell on both sides of the interleaved
    # repeats and widened their range; foreign load in either run gives no verdict
    new["drifted"] = ["sync"]
    verdicts = {v.figure: v.verdict for v in compare.compare(base, new)}
    assert verdicts == {"async_speedup": "regressed",
                        "weight_sync_efficiency": "regressed, drifted (new)"}
    lines, status = compare.comparison(base, new)
    assert status == 1 and "| **regressed**, drifted (new) |" in "\n".join(lines)
    base["loaded"] = ["sync"]
    verdicts = {v.figure: v.verdict for v in compare.compare(base, new)}
    assert verdicts == {"async_speedup": "regressed", "weight_sync_efficiency": "loaded (baseline)"}
    # the async part's speed probes (load.py): the new run's machine a third slower than the
    # baseline's, which moves an async/sync ratio by itself (docs/benchmarks.md)
    base["load"], new["load"] = {"async": {"probe_s": [0.06, 0.06]}}, {"async": {"probe_s":
                                                                                 [0.08, 0.08]}}
    assert compare.compare(base, new)[0].verdict == "machine 1.33x slower (new)"
    new["load"]["async"]["probe_s"] = [0.062, 0.064]  # within 10%: judged
    assert compare.compare(base, new)[0].verdict == "regressed"
    only = compare.compare(base, new, parts={"async"})  # a `run.py --parts async` run
    assert [v.figure for v in only] == ["async_speedup"]
    lines, status = compare.comparison(base, new, parts={"sync"})
    assert status == 0 and lines[-1] == "no headline regressed", lines


def test_compare_exits_1_on_a_regression_and_2_on_files_it_cannot_compare(tmp_path):
    """The command as a user runs it, on the committed full results and a copy in which one
    headline lost every repeat."""
    repo = BENCH.parents[1]
    committed = json.loads((repo / "bench_results.json").read_text())
    worse = json.loads(json.dumps(committed))
    low = worse["longtail"]["async_over_colocated"]["min"]  # every repeat below the old ones
    worse["longtail"]["async_over_colocated"] = rec(0.6 * low, 0.65 * low, 0.7 * low)
    worse["headline"]["longtail_async_over_colocate"] = 0.65 * low
    (tmp_path / "worse.json").write_text(json.dumps(worse))

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, str(BENCH / "compare.py"), *args],
                              capture_output=True, text=True, timeout=120, cwd=repo)
    same = run("bench_results.json", "bench_results.json")
    assert same.returncode == 0 and "no headline regressed" in same.stdout, same.stdout
    lost = run("bench_results.json", str(tmp_path / "worse.json"))
    assert lost.returncode == 1, lost.stdout + lost.stderr
    assert "| `longtail_async_over_colocate` |" in lost.stdout
    row = next(x for x in lost.stdout.splitlines() if "`longtail_async_over_colocate`" in x)
    assert row.endswith("| **regressed** |"), row
    assert lost.stdout.rstrip().endswith("regressed: longtail_async_over_colocate")
    mixed = run("bench_results.json", "bench_results_quick.json")
    assert mixed.returncode == 2 and "bench_results_quick.json is a --quick run" in mixed.stderr
    (tmp_path / "junk.json").write_text("[1, 2]")
    junk = run(str(tmp_path / "junk.json"), "bench_results.json")
    assert junk.returncode == 2 and "junk.json: no 'headline' map" in junk.stderr, junk.stderr


def test_run_checks_its_baseline_before_measuring_anything(tmp_path):
    """`run.py --quick --baseline bench_results.json` (a full run's): refused at once, naming
    the option, before any part runs or any file is written."""
    repo = BENCH.parents[1]
    proc = subprocess.run([sys.executable, str(BENCH / "run.py"), "--quick", "--parts", "broker",
                           "--baseline", str(repo / "bench_results.json"), "--out",
                           str(tmp_path / "out"), "--doc", str(tmp_path / "doc.md")],
                          capture_output=True, text=True, timeout=120, cwd=repo)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "--baseline: this run is a --quick run" in proc.stderr, proc.stderr
    assert not (tmp_path / "out").exists() and not (tmp_path / "doc.md").exists()


def test_a_reward_delta_is_not_compared_between_a_quick_and_a_full_run():
    """A final reward after 40 steps and after 150 are two quantities (docs/benchmarks.md):
    the table says so instead of a ratio of two numbers near 0."""
    def res(quick: bool, delta: float) -> dict:
        return {"quick": quick, "headline": {"async_reward_delta": delta},
                "async": {"staleness1": {"reward_delta": common.spread([delta] * 3)}}}
    [row] = report.headline_table(res(False, 0.12), res(True, -0.01))[2:]
    assert row.endswith("| - (learning: full length only) |"), row
