"""Run every benchmark, write bench_results.json, docs/benchmarks.md and the reward plots.

    python tools/bench/run.py [--quick] [--out bench_out] [--parts async,trl,sync,broker,engines]
    python tools/bench/run.py --quick --parts sglang  # the real SGLang server (~10 min)
    python tools/bench/run.py --quick --parts towers  # megatron's towers at TP=2 (~12 min)
    python tools/bench/run.py --parts longtail --repeats 2  # the long-tail workload (~30 min)
    python tools/bench/run.py --quick --baseline BASE.json  # then compare.py: exit 1 on a loss

Needs the bench extra (`pip install -e ".[bench]"`: TRL for the peer comparison, matplotlib
for the plots) and an otherwise idle machine: every figure is a ratio of two measurements
taken in this invocation, but other load still changes which side of a ratio it hits. So the
bench measures the cores other processes keep busy (load.py): it refuses to start on a loaded
machine (`--allow-load` goes on anyway) and marks every part that met foreign load.

Every headline is the median of interleaved repeats (three by default), with its spread
(max - min over the median) beside it. `--quick` is the same workload with fewer steps per
run (~15 min on 2 cores), the full run the preset's length (~30-60 min); the two write
bench_results_quick.json and bench_results.json, and docs/benchmarks.md shows them side by
side. A run of some parts updates those parts of the existing results and keeps the others
(each figure stays a ratio of two measurements of one invocation; the doc names each part's
command).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import async_sync  # noqa: E402
import broker_bench  # noqa: E402
import compare  # noqa: E402
import engine_scaling  # noqa: E402
import longtail  # noqa: E402
import report  # noqa: E402
import routing_bench  # noqa: E402
import scaling  # noqa: E402
import sglang_bench  # noqa: E402
import towers_bench  # noqa: E402
import weight_sync_bench  # noqa: E402
from common import REPO, Run, machine, make_assets, spread  # noqa: E402
from load import ForeignLoad, idle_check  # noqa: E402

PARTS = ("async", "trl", "sync", "broker", "engines", "routing", "longtail", "sglang", "towers")


# TRL's best lr on this task: final reward (mean of the last 10 of 150 steps) over seeds 0/1/2,
# session 13: 1e-3 0.56/0.76/0.68, 2e-3 (our preset's) 0.73/0.81/0.66, 3e-3 0.89/0.90/0.60,
# 5e-3 0.61/0.67/0.49 (docs/benchmarks.md#trl-grpotrainer)
TRL_LR = 3e-3


def run_trl(out: Path, model: Path, data: Path, steps: int, repeats: int) -> list[Run]:
    """TRL's GRPOTrainer, repeat i with seed=i like our runs, at TRL_LR (its best on this task,
    docs/benchmarks.md#trl-grpotrainer)."""
    runs = []
    for rep in range(repeats):
        jsonl = out / f"trl_rep{rep}.jsonl"
        t0 = time.monotonic()
        subprocess.run([sys.executable, str(Path(__file__).parent / "trl_peer.py"),
                        "--model", str(model), "--data", str(data), "--steps", str(steps),
                        "--out", str(jsonl), "--lr", str(TRL_LR), "--seed", str(rep)],
                       cwd=REPO, check=True, capture_output=True, timeout=3600)
        rows = [json.loads(x) for x in jsonl.read_text().splitlines()]
        # the same keys as our metrics, so Run's reductions apply unchanged
        run = Run(rows=[{"perf/step_time_s": r["step_time_s"], "rollout/reward_mean": r["reward"],
                         "train/samples": r["samples"]} for r in rows],
                  wall_s=time.monotonic() - t0)
        print(f"  TRL rep {rep}: {run.samples_per_s():.0f} samples/s, final reward "
              f"{run.final_reward():.3f}", flush=True)
        runs.append(run)
    return runs


def time_ratio(theirs: float | None, ours: float | None) -> float | None:
    """Their time to a reward over ours (> 1: ours gets there sooner); inf when only ours
    gets there, None when ours does not."""
    if ours is None:
        return None
    return float("inf") if theirs is None else theirs / ours


def headline(res: dict) -> dict[str, float]:
    """The figures the issue names, each a ratio measured in this invocation (medians)."""
    out: dict[str, float] = {}
    a = res.get("async")
    if a:
        out["async_speedup"] = a["staleness1"]["speedup"]["median"]
        out["async_reward_delta"] = a["staleness1"]["reward_delta"]["median"]
        out["async_bound_ratio"] = a["staleness1"]["bound_ratio"]["median"]
        out["sync_bound_ratio"] = a["sync_bound_ratio"]["median"]
        out["async_train_slowdown"] = a["staleness1"]["train_slowdown"]["median"]
        out["async_gen_slowdown"] = a["staleness1"]["gen_slowdown"]["median"]
    if res.get("trl"):
        out["trl_speedup"] = res["trl"]["ours_async_over_trl"]["median"]
        out["trl_speedup_sync"] = res["trl"]["ours_sync_over_trl"]["median"]
        out["trl_time_to_0.8_ratio"] = res["trl"]["time_to_0.8_trl_over_ours_async"]["median"]
    if res.get("weight_sync"):
        out["weight_sync_efficiency"] = res["weight_sync"]["large"]["efficiency"]["median"]
        out["weight_sync_efficiency_tiny"] = res["weight_sync"]["tiny"]["efficiency"]["median"]
        for size, suffix in (("large", ""), ("tiny", "_tiny")):
            flat = res["weight_sync"][size].get("efficiency_flattened")
            if flat:
                out[f"weight_sync_efficiency_flattened{suffix}"] = flat["median"]
    if res.get("broker"):
        out["broker_step_share"] = res["broker"]["step_share"]["median"]
    if res.get("engines"):
        out["engine_scaling"] = res["engines"]["gen_speedup"]["median"]
    if res.get("routing"):
        out["routing_replay_train_ratio"] = res["routing"]["replayed_train_ratio"]["median"]
        out["routing_replay_step_ratio"] = res["routing"]["replayed_step_ratio"]["median"]
    if res.get("longtail"):
        lt = res["longtail"]
        out["longtail_async_over_colocate"] = lt["async_over_colocated"]["median"]
        out["longtail_async_over_colocate_time_to_reward"] = (
            lt["async_over_colocated_time_to_reward"]["median"])
        if "async_over_colocated_1t" in lt:
            out["longtail_async_over_colocate_1t"] = lt["async_over_colocated_1t"]["median"]
            out["longtail_async_over_colocate_1t_time_to_reward"] = (
                lt["async_over_colocated_1t_time_to_reward"]["median"])
        out["longtail_reward_delta"] = lt["reward_delta"]["median"]
        out["rollout_overhead_ratio"] = lt["rollout_overhead_ratio"]["median"]
        if "rollout_overhead_ratio_1t" in lt:
            out["rollout_overhead_ratio_1t"] = lt["rollout_overhead_ratio_1t"]["median"]
        out["rollout_overhead_ratio_tiny"] = lt["rollout_overhead_ratio_tiny"]["median"]
        out["longtail_sync_bound_ratio"] = lt["sync_bound_ratio"]["median"]
        out["longtail_sync_share_overlap"] = lt["modes"]["async"]["sync_share"]["median"]
        out["longtail_sync_share_no_overlap"] = (
            lt["modes"]["async_no_overlap"]["sync_share"]["median"])
    if res.get("sglang"):
        sg = res["sglang"]
        out["sglang_async_speedup"] = sg["async_speedup"]["median"]
        out["sglang_async_over_colocate"] = sg["async_over_colocated"]["median"]
        out["sglang_rollout_overhead_ratio"] = sg["rollout_overhead_ratio"]["median"]
    if res.get("towers"):
        out["towers_split_train_ratio"] = res["towers"]["split_train_ratio"]["median"]
        out["towers_split_step_ratio"] = res["towers"]["split_step_ratio"]["median"]
    return out


def missing_extras(parts: set[str]) -> list[str]:
    """The bench extra's modules that `parts` need and this interpreter cannot import: TRL for
    part 3, matplotlib for the reward plots (written at the end of any run)."""
    need = {"matplotlib"} | ({"trl"} if "trl" in parts else set())
    return sorted(m for m in need if importlib.util.find_spec(m) is None)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="the same workload with fewer steps per run")
    ap.add_argument("--out", type=Path, default=REPO / "bench_out")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"subset of {','.join(PARTS)}")
    ap.add_argument("--repeats", type=int, default=None,
                    help="interleaved repeats per measurement (default 3)")
    ap.add_argument("--allow-load", action="store_true",
                    help="start even if other processes keep the machine busy (the parts that "
                         "met the load are marked in the results)")
    ap.add_argument("--reuse-runs", action="store_true",
                    help="longtail: read the runs a previous invocation finished in --out")
    ap.add_argument("--doc", type=Path, default=REPO / "docs" / "benchmarks.md")
    ap.add_argument("--baseline", type=Path, default=None,
                    help="a bench_results*.json to compare this run's headlines with at the end "
                         "(tools/bench/compare.py; exit status 1 when one regressed). Read now: "
                         "this run rewrites the repository's own")
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    if unknown := parts - set(PARTS):
        ap.error(f"--parts: unknown {sorted(unknown)}; choose from {','.join(PARTS)}")
    baseline = None
    if args.baseline is not None:  # before anything runs (and before this run rewrites it)
        try:
            baseline = compare.load_results(args.baseline)
            compare.check_comparable(baseline, {"quick": args.quick}, args.baseline,
                                     Path("this run"))
        except ValueError as e:
            ap.error(f"--baseline: {e}")
    if missing := missing_extras(parts):  # (at the start, not after the parts before it)
        # (leaving part 3 out helps only without TRL: the plots need matplotlib in any run)
        other = ", or leave part 3 out (--parts without trl)" if missing == ["trl"] else ""
        ap.error(f"{' and '.join(missing)} cannot be imported: install the bench extra, "
                 f"pip install -e \".[bench]\"{other}")
    steps = 40 if args.quick else 150  # the preset's length
    repeats = args.repeats or 3
    idle = idle_check()
    if idle.get("loaded") and not args.allow_load:
        print(f"run.py: other processes keep {idle['mean_cores']:.2f} cores of "
              f"{os.cpu_count()} busy (max {idle['max_cores']:.2f}); every figure here is a "
              "ratio that such load skews. Stop them, or pass --allow-load to measure anyway "
              "(the results are then marked loaded).", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    model = make_assets(args.out / "assets")
    data = args.out / "assets" / "arith_train.jsonl"
    command = " ".join(["python", "tools/bench/run.py", *sys.argv[1:]])
    res: dict = {"machine": machine(), "quick": args.quick, "repeats": repeats, "steps": steps,
                 "command": command}
    previous = REPO / report.results_name(args.quick)
    if parts != set(PARTS) and previous.exists():  # some parts: update them, keep the rest
        res = json.loads(previous.read_text())
        res.setdefault("commands", {p: res["command"] for p in PARTS if p not in parts})
    res.setdefault("commands", {}).update({p: command for p in parts})
    res.setdefault("load", {})["idle_check"] = idle
    part_load = ForeignLoad(interval_s=1.0)
    t_start = time.monotonic()
    part_load.__enter__()
    cores = os.sched_getaffinity(0)

    def start_part(name: str) -> None:
        # every part starts on the cores the bench was given: runs of an unpinned mode inherit
        # this process's, and a part that pinned it and kept it so put every later part's runs
        # on one core (session 39: part 5 did, which halved the colocated long tail)
        if (now := os.sched_getaffinity(0)) != cores:
            print(f"warning: the bench was left pinned to cores {sorted(now)} before part "
                  f"{name!r}; back on {sorted(cores)}", flush=True)
            os.sched_setaffinity(0, cores)
        part_load.part(name)
    runs: dict[str, list[Run]] = {}
    lt_plot: list[Path] = []

    if "async" in parts:
        start_part("async")
        print("[1-2] async vs sync", flush=True)
        modes = async_sync.run_modes(args.out / "async", model, data, steps=steps,
                                     repeats=repeats)
        res["async"] = async_sync.summarize(modes)
        runs |= {f"ours max_staleness={s}": rs for s, rs in modes.items()}
    if "trl" in parts:
        start_part("trl")
        print("[3] TRL GRPOTrainer", flush=True)
        trl = run_trl(args.out / "trl", model, data, steps, repeats)
        trl_sps = [r.samples_per_s() for r in trl]
        res["trl"] = {"lr": TRL_LR, "samples_per_s": spread(trl_sps),
                      "final_reward": spread([r.final_reward() for r in trl]),
                      "time_to_reward_s": spread([r.time_to(async_sync.REWARD_THRESHOLD)
                                                  for r in trl]),
                      "time_to_0.8_s": spread([r.time_to(async_sync.TRL_THRESHOLD)
                                               for r in trl]),
                      "reached_0.8": sum(r.time_to(async_sync.TRL_THRESHOLD) is not None
                                         for r in trl)}
        if "async" in parts:
            for name, s in (("ours_sync_over_trl", 0), ("ours_async_over_trl", 1)):
                res["trl"][name] = spread([o.samples_per_s() / t
                                           for o, t in zip(modes[s], trl_sps)])
            # the same seed's runs paired, as the samples/s ratios are
            res["trl"]["time_to_0.8_trl_over_ours_async"] = spread([
                time_ratio(t.time_to(async_sync.TRL_THRESHOLD),
                           o.time_to(async_sync.TRL_THRESHOLD)) for o, t in zip(modes[1], trl)])
        runs["TRL GRPOTrainer"] = trl
    if "sync" in parts:
        start_part("sync")
        print("[4] weight sync", flush=True)
        big = weight_sync_bench.make_state_model(args.out / "assets" / "state500",
                                                 480)
        res["weight_sync"] = {}
        for name, m in (("tiny", model), ("large", big)):
            # the same rounds quick or full (weight_sync_bench.ROUNDS): no steps to shorten
            r = weight_sync_bench.measure(m, repeats, args.out)
            res["weight_sync"][name] = {
                "mb": r["mb"], "tensors": r["tensors"], "buckets": r["buckets"],
                "rounds": r["rounds"],
                "full_gbps": spread(r["full_gbps"]), "raw_gbps": spread(r["raw_gbps"]),
                "full_s": spread(r["full_s"]), "raw_s": spread(r["raw_s"]),
                "efficiency": spread(r["efficiency"]),
                "efficiency_flattened": spread(r["efficiency_flattened"])}
    if "broker" in parts:
        start_part("broker")
        print("[5] broker", flush=True)
        # the same calls quick or full (no steps to shorten: a different count was a different
        # workload, and the quick run's 10 calls weighed its slow first ones: 0.030 against
        # the full run's 0.022); a repeat is the median of its CALLS_PER_REPEAT calls in turn
        calls = broker_bench.CALLS_PER_REPEAT
        b = broker_bench.measure(args.out, calls * repeats)
        step = (res["async"]["sync_components"]["step_s"]["median"] if "async" in res
                else None)
        res["broker"] = {
            "samples_per_s": spread(b["broker"]["samples_per_s"]),
            "mb_per_s": spread(b["broker"]["mb_per_s"]),
            "raw_samples_per_s": spread(b["raw"]["samples_per_s"]),
            "raw_mb_per_s": spread(b["raw"]["mb_per_s"]),
            "throughput_ratio": spread(b["throughput_ratio"]),
            "get_batch_s": spread(b["broker"]["get_batch_s"]),
            "payload_mb": b["broker"]["payload_mb"],
            "step_share": spread([g / step for g in weight_sync_bench.per_repeat(
                b["broker"]["get_batch_s"], calls)] if step else []),
        }
    if "engines" in parts:
        start_part("engines")
        print("[7] engines: rollout throughput with 1 and 3 engines", flush=True)
        res["engines"] = engine_scaling.measure(args.out / "engines", model, data,
                                                steps=40 if args.quick else 60, repeats=repeats)
    if "routing" in parts:
        start_part("routing")
        print("[8] routing replay: the tiny MoE with routing off, recorded, replayed", flush=True)
        res["routing"] = routing_bench.measure(args.out, data, steps=40 if args.quick else 60,
                                               repeats=repeats)
    if "longtail" in parts:
        start_part("longtail")
        print("[9] long tail: colocated sync vs async with streaming and overlap", flush=True)
        lt_data = args.out / "assets" / "longtail_train.jsonl"
        if not lt_data.exists():
            subprocess.run([sys.executable, "tools/prepare_data.py", "--task", "longtail",
                            "--out", str(lt_data.parent)], cwd=REPO, check=True,
                           capture_output=True)
        res["longtail"], lt_runs = longtail.measure(
            args.out / "longtail", model, lt_data, data, steps=20 if args.quick else 40,
            repeats=repeats, reuse=args.reuse_runs)
        lt_plot = report.plot_rewards({f"long tail {m}": rs for m, rs in lt_runs.items()
                                       if m != "tiny_sync"}, REPO / "docs" / "img",
                                      filename=report.LONGTAIL_PLOT,
                                      title="tiny GRPO, long tail (d*n=, 16 prompts x 16)")
    if "sglang" in parts:
        start_part("sglang")
        print("[10] the real SGLang server: sync, async, colocated", flush=True)
        res["sglang"], sg_runs = sglang_bench.measure(args.out / "sglang", model, data,
                                                      steps=40 if args.quick else 60,
                                                      repeats=repeats)
        runs |= {f"sglang {m}": rs for m, rs in sg_runs.items()}
    if "towers" in parts:
        start_part("towers")
        print("[11] towers: the tiny Qwen3-Omni at TP=2, replicated vs split", flush=True)
        res["towers"] = towers_bench.measure(args.out, steps=10 if args.quick else 20,
                                             repeats=repeats)
    if "async" in res:
        c = res["async"]["sync_components"]
        costs = scaling.Costs(G=c["G_s"]["median"], T=c["T_s"]["median"] - c["weight_sync_s"]
                              ["median"], S=c["weight_sync_s"]["median"])
        res["scaling"] = {str(tail): scaling.sketch(scaling.Costs(**{**vars(costs),
                                                                      "tail": tail}))
                          for tail in (1.0, 2.0, 3.0)}
        res["scaling_costs"] = vars(costs)

    if "longtail" in res:
        # the long-tail costs (a colocated run: generation and training on the same cores); G
        # without the tail = the measured span / the tail (a batch of hf generation
        # costs its longest row's decode steps, a batch of mean length the mean's)
        lt = res["longtail"]
        # the 1-thread control where measured: 2-thread processes on a shared machine lose
        # more to oversubscription than to the workload
        col = lt["modes"].get("colocated_1t") or lt["modes"]["colocated"]
        tail = lt["response_len"]["async_no_overlap"]["tail"]
        costs = scaling.Costs(G=col["gen_time_s"]["median"] / tail,
                              T=col["train_time_s"]["median"],
                              S=col["weight_sync_s"]["median"], tail=tail)
        res["scaling_longtail_costs"] = vars(costs)
        res["scaling_longtail"] = {
            name: scaling.sketch(scaling.Costs(**{**vars(costs), "engine_tail": et}))
            for name, et in (("continuous batching (sglang)", 1.0),
                             ("one generate per batch (hf)", tail))}
    part_load.__exit__(None, None, None)
    res["load"].update(part_load.parts())
    res["loaded"] = sorted(p for p, load in res["load"].items()
                           if p != "idle_check" and load.get("loaded"))
    res["drifted"] = sorted(p for p, load in res["load"].items() if load.get("drifted"))
    if parts == set(PARTS) or "elapsed_s" not in res:  # a partial run keeps the full one's
        res["elapsed_s"] = time.monotonic() - t_start
    res["headline"] = headline(res)
    name = report.results_name(args.quick)
    (args.out / name).write_text(json.dumps(res, indent=2, default=str))
    (REPO / name).write_text(json.dumps(res, indent=2, default=str))
    other = REPO / report.results_name(not args.quick)  # the other kind, shown beside
    # a run without part 1's learning runs keeps the plot of the last one that had them (a
    # `--parts sglang` run would otherwise draw its own runs alone over it)
    kept = REPO / "docs" / "img" / report.REWARD_PLOT
    plots = (report.plot_rewards(runs, REPO / "docs" / "img") if "async" in parts
             else [kept] if kept.exists() else [])
    kept_lt = REPO / "docs" / "img" / report.LONGTAIL_PLOT
    plots += lt_plot if "longtail" in parts else [kept_lt] if kept_lt.exists() else []
    args.doc.write_text(report.markdown(res, plots, args.doc,
                                        json.loads(other.read_text()) if other.exists() else None))
    print(json.dumps(res["headline"], indent=2))
    if res["loaded"]:
        print(f"foreign load met in {res['loaded']}: those figures are marked", file=sys.stderr)
    if res["drifted"]:
        print(f"the machine's speed moved during {res['drifted']} (load.py speed_probe): those "
              "figures are marked", file=sys.stderr)
    print(f"wrote {name}, {args.doc}, {len(plots)} plot(s) in {res['elapsed_s']:.0f} s")
    if baseline is None:
        return 0
    lines, status = compare.comparison(baseline, res, parts)
    print(f"against {args.baseline} (the parts measured now):")
    print("\n".join(lines))
    return status


if __name__ == "__main__":
    sys.exit(main())
