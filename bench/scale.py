"""Scale-out figures: the data-parallel update (2 ranks vs 1) and the store on SQLite vs PostgreSQL.

1. DDP: SmolLM2-135M-Instruct (`--model`, default smollm2) and one fixed batch shaped like a calc-demo
   step (`--groups` × `--rows` rows: a shared 300-token system prompt, completions, a tool result), random
   token ids and non-zero advantages so every row runs. One AdamW update (lr 1e-5, the default) with 1
   rank (all `--threads` threads) and with 2 ranks over gloo (`--threads`/2 each), from the same weights:
   the update time of each (median of `--repeats`, a fresh update each) and `ddp_2rank_max_weight_diff`,
   the largest absolute weight difference after the step.
1c. bf16 (`bench/scale_bf16.py`): `train.dtype` bfloat16 against float32 on the same rows (update peak RSS
   ratio, logprob difference, 2 FSDP ranks in bf16 against 1 process); 1d. loading a 1.5B-shaped model
   onto FSDP ranks, 2 vs 1 (`bench/scale_load.py`, `fsdp_load_rank_peak_mb_ratio`).
1b. FSDP (`bench/scale_fsdp.py`): 2 sharded ranks against 1 process over 3 AdamW updates on the same
   weights and batches (`fsdp_2rank_max_weight_diff`), rank 0's peak of parameters + gradients + optimizer
   state against the 1-process figure (`fsdp_rank_peak_mb_ratio`), the weight gather and push time, and a
   2-rank checkpoint resumed at 1 rank and back.
2. Store: `--calls` calls of ~14 kB (about what a calc call weighs) written in group commits of 8, as the
   gateway's writer does under load, on one thread: calls/s and the median commit latency, on a SQLite
   file and on a throwaway local PostgreSQL (fsync on, as a real server); then PostgreSQL with 2 store
   instances (two gateway replicas' worth) writing from 4 threads.
3. Gateways (`bench/scale_gateways.py`): model calls/s through 1 gateway on SQLite, 1 on PostgreSQL and 2
   replicas on PostgreSQL (`rps_by_replicas`), then `kill -9` of one of 2 replicas under load
   (`replica_kill_lost_calls`, time for the moved rollouts to get answers again).

    python bench/scale.py --out bench/results/scale.json     # make bench-scale (about 5-7 minutes)
    python bench/scale.py --skip-ddp --skip-store --merge    # only the gateways (and FSDP), kept beside the rest
    python bench/scale.py --skip-ddp --skip-store --skip-gateways --merge    # only the FSDP figures
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench.scale_gateways


def demo_batch(groups: int, rows_per_group: int, seed: int = 0) -> Any:
    """`groups` × `rows_per_group` rows shaped like the calc example's (see the module docstring)."""
    from harnessrl.adapter import Batch, LossMode, Row, loss_weights

    rnd = random.Random(seed)
    tok = lambda n: [rnd.randint(3, 49000) for _ in range(n)]  # noqa: E731
    system = tok(300)
    rows = []
    for g in range(groups):
        prompt = system + tok(37)
        for k in range(rows_per_group):
            first, obs, second = tok(rnd.randint(20, 96)), tok(rnd.randint(10, 20)), tok(rnd.randint(5, 60))
            tokens = prompt + first + obs + second
            mask = [0] * len(prompt) + [1] * len(first) + [0] * len(obs) + [1] * len(second)
            rows.append(Row(f"r{g}-{k}", tokens, mask, [rnd.uniform(-3.0, -0.01) * m for m in mask], 1.0))
    advantages = [rnd.choice((-1.0, 1.0)) * rnd.uniform(0.2, 1.5) for _ in rows]
    return Batch(rows, advantages, loss_weights(rows, LossMode.ROLLOUT_TOKEN_MEAN), {})


def bench_ddp(model_name: str, groups: int, rows: int, threads: int, repeats: int) -> dict[str, Any]:
    import torch

    from harnessrl.modeling.loading import load_model, resolve_model
    from harnessrl.trainer.distributed import DataParallel
    from harnessrl.trainer.ppo import PPOConfig, ppo_update

    model_dir = resolve_model(model_name)
    batch = demo_batch(groups, rows)
    cfg = PPOConfig()

    def fresh() -> tuple[Any, Any]:
        model = load_model(model_dir)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-5)

    torch.set_num_threads(threads)
    one_times = []
    for _ in range(repeats):
        single, opt = fresh()
        t0 = time.perf_counter()
        ppo_update(single, opt, batch, cfg)
        one_times.append(time.perf_counter() - t0)
    model, opt2 = fresh()
    dp = DataParallel(model, opt2, model_dir, 2, threads=max(1, threads // 2))
    two_times = []
    try:
        for i in range(repeats):
            if i:  # every timed update starts from the initial weights and a fresh optimizer
                init, _ = fresh()
                with torch.no_grad():
                    for p, q in zip(model.parameters(), init.parameters(), strict=True):
                        p.copy_(q)
                opt2.state.clear()
                dp.sync_state()
            t0 = time.perf_counter()
            dp.update(batch, cfg)
            two_times.append(time.perf_counter() - t0)
        lockstep = dp.divergence()
    finally:
        dp.close()
    diff = max(float((a.detach() - b.detach()).abs().max()) for a, b in
               zip(single.parameters(), model.parameters(), strict=True))  # fmt: skip
    moved = max(float((a.detach() - b.detach()).abs().max()) for a, b in
                zip(single.parameters(), fresh()[0].parameters(), strict=True))  # fmt: skip
    t1, t2 = statistics.median(one_times), statistics.median(two_times)
    return {
        "model": str(model_name), "rows": len(batch.rows), "tokens": sum(len(r.tokens) for r in batch.rows),
        "trainable_tokens": batch.n_trainable_tokens, "threads_total": threads,
        "ddp_2rank_max_weight_diff": diff, "max_weight_change_of_the_step": moved,
        "ranks_lockstep_max_diff": lockstep,
        "update_s_1rank": t1, "update_s_2rank": t2, "speedup_2rank": t1 / t2,
        "update_s_1rank_all": one_times, "update_s_2rank_all": two_times,
    }  # fmt: skip


def _calls(rollout_id: str, n: int, start: int) -> list[Any]:
    from harnessrl.schema import Call, CallStatus, now

    content = "x" * 14_000
    return [Call(call_id=f"{rollout_id}-{start + i}", rollout_id=rollout_id, attempt=0, created_at=now(),
                 latency_s=0.0, status=CallStatus.OK, model="m", upstream="u",
                 request={"messages": [{"role": "user", "content": content}]}) for i in range(n)]  # fmt: skip


def _write(store: Any, rollout_ids: list[str], batches: int, batch: int) -> list[float]:
    lat = []
    for b in range(batches):
        rid = rollout_ids[b % len(rollout_ids)]
        calls = _calls(rid, batch, b * batch)
        t0 = time.perf_counter()
        store.add_calls(calls)
        lat.append(time.perf_counter() - t0)
    return lat


def bench_store(calls: int, batch: int = 8) -> dict[str, Any]:
    from harnessrl.schema import RolloutCreate
    from harnessrl.store import SQLiteStore
    from harnessrl.store.pg_local import LocalPostgres
    from harnessrl.store.postgres import PostgresStore

    out: dict[str, Any] = {"calls": calls, "calls_per_commit": batch, "call_bytes": 14_000}

    def one(store: Any, label: str, tag: str) -> None:
        rids = []
        for i in range(16):
            ro, _ = store.create_rollout(RolloutCreate(client_id=f"{tag}-{i}", task_id="t"), f"{tag}-{i}")
            rids.append(ro.rollout_id)
        t0 = time.perf_counter()
        lat = _write(store, rids, calls // batch, batch)
        wall = time.perf_counter() - t0
        out[label] = {"calls_per_s": calls / wall, "commit_ms_p50": 1000 * statistics.median(lat),
                      "commit_ms_p99": 1000 * sorted(lat)[int(0.99 * (len(lat) - 1))]}  # fmt: skip

    with tempfile.TemporaryDirectory() as d:
        s = SQLiteStore(Path(d) / "store.sqlite")
        one(s, "sqlite", "s")
        s.close()
    with LocalPostgres(fsync=True) as pg:
        url = pg.create_database("bench")
        p = PostgresStore(url)
        one(p, "postgres", "p")
        # two replicas' store instances, two writer threads each (the gateway writes from its loop)
        replicas = [p, PostgresStore(url)]
        rids = []
        for i in range(16):
            ro, _ = p.create_rollout(RolloutCreate(client_id=f"c-{i}", task_id="t"), f"c-{i}")
            rids.append(ro.rollout_id)
        lat: list[float] = []
        lock = threading.Lock()

        def worker(n: int) -> None:
            mine = _write(replicas[n % 2], rids[n::4], calls // batch // 4, batch)
            with lock:
                lat.extend(mine)

        t0 = time.perf_counter()
        threads = [threading.Thread(target=worker, args=(n,)) for n in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        written = len(lat) * batch
        assert sum(p.count_calls(r) for r in rids) == written
        out["postgres_2replicas_4threads"] = {"calls_per_s": written / wall,
                                              "commit_ms_p50": 1000 * statistics.median(lat)}  # fmt: skip
        for r in replicas:
            r.close()
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="bench/results/scale.json")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--groups", type=int, default=2)
    p.add_argument("--rows", type=int, default=4, help="rows per group")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--calls", type=int, default=4000)
    p.add_argument("--skip-store", action="store_true")
    p.add_argument("--skip-ddp", action="store_true")
    p.add_argument("--skip-fsdp", action="store_true")
    p.add_argument("--fsdp-rows", type=int, default=2, help="rows per FSDP update (3 updates, 1 group)")
    p.add_argument(
        "--fsdp-model", default=None, help="the FSDP part's model (default: --model; or small-random)"
    )
    p.add_argument(
        "--skip-bf16", action="store_true", help="skip train.dtype bfloat16 vs float32 (scale_bf16.py)"
    )
    p.add_argument("--bf16-model", default=None, help="the bf16 part's model (default: --model)")
    p.add_argument("--bf16-rows", type=int, default=4, help="rows of the bf16 vs fp32 update (1 group)")
    p.add_argument(
        "--skip-load", action="store_true", help="skip the FSDP load, 2 ranks vs 1 (scale_load.py)"
    )
    p.add_argument("--skip-gateways", action="store_true")
    p.add_argument("--gateway-seconds", type=float, default=10.0, help="load per gateway measurement")
    p.add_argument("--gateway-concurrency", type=int, default=16, help="rollouts calling at once")
    p.add_argument("--merge", action="store_true", help="keep the parts of --out this run skips")
    args = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    out = Path(args.out)
    result: dict[str, Any] = json.loads(out.read_text()) if args.merge and out.exists() else {}
    result["machine"] = {"cpus": os.cpu_count(), "python": platform.python_version(),
                         "load_avg_at_start": os.getloadavg()}  # fmt: skip
    result["command"] = " ".join(["python", *sys.argv])
    if not args.skip_ddp:
        result["ddp"] = bench_ddp(args.model, args.groups, args.rows, args.threads, args.repeats)
        result["ddp_2rank_max_weight_diff"] = result["ddp"]["ddp_2rank_max_weight_diff"]
        print(json.dumps(result["ddp"], indent=2), flush=True)
    if not args.skip_fsdp:
        from bench.scale_fsdp import bench_fsdp

        result["fsdp"] = bench_fsdp(args.fsdp_model or args.model, 1, args.fsdp_rows, args.threads)
        result["fsdp"].update(command=result["command"], load_avg_at_end=os.getloadavg())  # kept by --merge
        for key in ("fsdp_2rank_max_weight_diff", "fsdp_rank_peak_mb_ratio"):
            result[key] = result["fsdp"][key]
        print(json.dumps(result["fsdp"], indent=2), flush=True)
    if not args.skip_bf16:
        from bench.scale_bf16 import bench_bf16

        result["bf16"] = bench_bf16(args.bf16_model or args.model, 1, args.bf16_rows, 1)
        result["bf16"].update(command=result["command"], load_avg_at_end=os.getloadavg())
        print(json.dumps(result["bf16"], indent=2), flush=True)
    if not args.skip_load:
        from bench.scale_load import bench_load, write_model

        result["fsdp_load"] = bench_load(write_model(Path(tempfile.gettempdir()) / "harnessrl-1.5b-shaped"))
        result["fsdp_load_rank_peak_mb_ratio"] = result["fsdp_load"]["fsdp_load_rank_peak_mb_ratio"]
        print(json.dumps(result["fsdp_load"], indent=2), flush=True)
    if not args.skip_store:
        result["store"] = bench_store(args.calls)
        print(json.dumps(result["store"], indent=2), flush=True)
    if not args.skip_gateways:
        import asyncio

        from bench.scale_gateways import bench_gateways

        gw = asyncio.run(bench_gateways(args.gateway_concurrency, args.gateway_seconds, args.gateway_seconds))
        result["gateways"] = gw
        result["rps_by_replicas"] = gw["rps_by_replicas"]
        result["replica_kill_lost_calls"] = gw["replica_kill_lost_calls"]
        print(json.dumps(gw, indent=2), flush=True)
    result["machine"]["load_avg_at_end"] = os.getloadavg()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
