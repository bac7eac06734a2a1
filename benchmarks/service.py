"""The Tinker service (issue 24): one client's SFT step through HTTP vs in-process, 4 clients vs 1, memory.

    .venv/bin/python benchmarks/service.py            # full run (~2.5 min quiet, 5-7 min loaded; --part overhead|clients)
    .venv/bin/python benchmarks/service.py --quick    # smoke test (~1.5 min: 5 jobs start; numbers mean nothing)

A client's step is the SDK's ``forward_backward(datums, "cross_entropy")`` then ``optim_step(AdamParams)``,
waiting for both results; its datums are ``rows`` rows of ``tokens`` input tokens (random token ids; target =
the next id, weight 1). Every client trains a rank-r adapter (alpha 2r) on all 7 projections
(``train_unembed=False``) of the same tiny llama.

**1. Overhead** (in this process, one :class:`~mlora_lab.job.trainer.Trainer` with a
:class:`~mlora_lab.job.drivers.tinker.driver.ServiceDriver`, one tenant per contender, all with the same rows; contenders
interleaved, 1 warm-up round, median of the repeats):

- ``step`` (the baseline): the step's two requests put into the inbox and :meth:`Trainer.step` called right
  here; its futures are settled when it returns. The engine step and the driver, nothing else (the driver's
  gather, :data:`~mlora_lab.job.drivers.tinker.plan.GATHER_QUIET_S` after the last request, included: every contender
  waits it out).
- ``inbox``: the same two requests put into the inbox while the training loop runs on a thread as a served
  job runs it (``trainer.train()``, its default idle wait), waiting on the futures as the HTTP server's
  long-poll does (on the server's event loop). The loop's wake-up, no HTTP.
- ``http``: the real SDK (``tinker`` 0.38.0) against the job's HTTP server on loopback (uvicorn on a thread,
  as in a served job), the same loop thread. SDK + HTTP + wire decoding + the loop's wake-up.

The SDK client runs in this process, so its own Python work (encoding, its event loop) competes with the
training loop for the GIL: counted against ``http`` (a served job has its clients in other processes). The
CPU column is the whole process's (every thread). Goal: http / step <= 1.10.

**2. Four clients vs one** (a real served job: ``ml.serve(spec)``, a torchrun job process, as users run it;
the clients are 4 ``ServiceClient`` s in threads of this process, as 4 programs would be, each with its own
rows). Rounds of: client 0 alone runs ``steps`` steps; then all 4 start together (a barrier) and each runs
``steps`` steps. rows/s = rows trained / wall time from the start to the end of the last client's last step
(a round's tail, where the last client may run alone, counts against the 4). 1 untimed warm-up step per
client first. Also shown: rows per CPU second of the job's processes (every thread: the loop and the HTTP
server), the share of the wall time the loop spent in steps (the job's system rows' step times: the rest it
waited for requests), and the job's own system rows (tenants and time of each step). Goal: rows/s with 4 clients >= 0.95 x rows/s with 1 (nothing lost to multiplexing).

**3. Memory**: the peak RSS of that 4-client job (after its rounds) vs the sum of the peak RSS of 4 served
jobs with one client each (``max_tenants=1``; started together, then each serves its client alone for 1 +
``steps`` steps). Peak RSS is the kernel's high-water mark of each process (``VmHWM`` in
``/proc/<pid>/status``: exact, not sampled), read before the job is stopped, summed over the job's processes:
the torchrun agent and the worker. The worker's own figure (the job's system rows record the same
``ru_maxrss``) is shown too, and the RSS of each job once up, before any client (``VmRSS``): what a job costs
before it trains anything, which one job shares among its clients. Goal: 4-client job / 4 one-client jobs
<= 0.35.

``--max-step-tokens N`` serves parts 2 and 3 with ``Service(max_step_tokens=N)``: a step of the loop then takes
clients' requests up to N datum tokens (N = ``rows x tokens``: one client's request per step).
``--max-pass-tokens N`` serves them with ``JobSpec(max_pass_tokens=N)``: the requests of clients that wait together
still share a step, and its forward + backward runs in passes of whole clients of at most N padded tokens. Without
it a served job on a CPU takes 1,024 (``rows x tokens``: one client's rows a pass); ``2**53 - 1`` runs a step in
one pass (the default before the pass budget).

Threads: ``--threads`` (default 1, as every benchmark here: see README) in this process
(``torch.set_num_threads``) and ``OMP_NUM_THREADS`` in the served jobs. Linux only (``/proc``).
"""

from __future__ import annotations

import asyncio
import os
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("TINKER_TELEMETRY", "0")  # the SDK sends nothing anywhere
sys.path.insert(0, str(Path(__file__).resolve().parent))

import common
import psutil
import torch

OVERHEAD_GOAL = 1.10  # step time, http / in-process: at most
CLIENTS_GOAL = 0.95  # rows/s, 4 clients / 1 client: at least
MEM_GOAL = 0.35  # peak RSS, one 4-client job / four 1-client jobs: at most
CLIENTS = 4
LR = 1e-4

FULL = dict(
    size=common.ModelSize(384, 6, 8, 4, 4096), rank=16, rows=8, tokens=128, repeats=6, steps=3, rounds=3
)
QUICK = dict(
    size=common.ModelSize(128, 2, 4, 2, 1024), rank=8, rows=8, tokens=32, repeats=2, steps=2, rounds=1
)


def random_rows(n: int, tokens: int, vocab: int, seed: int) -> list[tuple[list[int], list[int]]]:
    """``n`` datums ``(x [tokens], y [tokens])``: random ids, ``y`` is ``x`` shifted by one."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        ids = [rng.randrange(vocab) for _ in range(tokens + 1)]
        out.append((ids[:-1], ids[1:]))
    return out


def sdk_datums(rows: list[tuple[list[int], list[int]]]) -> list:
    from tinker import types

    return [
        types.Datum(
            model_input=types.ModelInput.from_ints(x),
            loss_fn_inputs={"target_tokens": y, "weights": [1.0] * len(y)},
        )
        for x, y in rows
    ]


def sdk_step(tc, datums: list) -> None:
    """One client step: forward_backward, then optim_step, both results waited for."""
    from tinker import types

    fb = tc.forward_backward(datums, "cross_entropy")
    step = tc.optim_step(types.AdamParams(learning_rate=LR))
    fb.result()
    step.result()


# -- 1. overhead (in this process) -----------------------------------------------------------------------


def overhead(cfg: dict, model_dir: str, repeats: int) -> dict:
    import tinker

    from mlora_lab.job.drivers.tinker.driver import ServiceDriver
    from mlora_lab.job.trainer import Trainer
    from mlora_lab.service import wire
    from mlora_lab.service.app import Server
    from mlora_lab.service.bodies import AdamStep, ModelInfo
    from mlora_lab.service.keys import Keys
    from mlora_lab.service.state import ServiceState
    from mlora_lab.service.work import Futures, Inbox, Kind, Work
    from mlora_lab.spec.job import JobSpec

    rank, tokens = cfg["rank"], cfg["tokens"]
    spec = JobSpec(
        base_model=model_dir,
        tenants=[],
        seq_len=tokens + 1,
        max_tenants=4,
        max_rank=rank,
        slot_modules=common.LLAMA_TARGETS,
    )
    keys = Keys()
    key = keys.add("owner")
    state = ServiceState(
        inbox=Inbox(),
        futures=Futures(),
        keys=keys,
        base_model=model_dir,
        limits=wire.Limits(1, 1),
        max_rank=rank,
        tokenizer_id=model_dir,
    )
    trainer = Trainer(
        spec, run_dir=None, drivers=(lambda parts: ServiceDriver(parts, state, lora_alpha=2 * rank),)
    )
    state.limits = wire.Limits(vocab_size=trainer.engine.vocab_rows, max_tokens=tokens)
    server = Server(state).start()
    # the loop thread steps through this gate: ``step`` holds it, so its steps are its own
    gate = threading.Lock()
    own_step = trainer.step

    def gated_step() -> bool:
        with gate:
            return own_step()

    trainer.step = gated_step  # (train() calls self.step())
    loop_thread = threading.Thread(target=trainer.train, daemon=True)  # the job's idle wait, as served
    loop_thread.start()
    rows = random_rows(cfg["rows"], tokens, cfg["size"].vocab_size, seed=0)
    datums = [
        wire.Datum(x, {"target_tokens": torch.tensor(y), "weights": torch.ones(len(y))}) for x, y in rows
    ]
    server_loop = state.futures._loop  # (the server's event loop: a settle wakes the long-polls there)

    def settled(request_id: str) -> None:
        result = asyncio.run_coroutine_threadsafe(state.futures.wait(request_id, 600), server_loop).result()
        assert result is not None and result.error is None, result

    def create(model_id: str) -> None:
        info = ModelInfo(model_id, "owner", model_dir, rank, 0, True, True, False)
        work = Work(Kind.CREATE_MODEL, state.futures.new(), "owner", model_id=model_id, body=info)
        state.inbox.put(work)
        settled(work.request_id)

    seqs: dict[str, int] = {}

    def put_step(model_id: str) -> list[str]:
        """The step's two requests into the inbox, as the HTTP routes queue them; their request ids."""
        ids = []
        for kind in (Kind.FORWARD_BACKWARD, Kind.OPTIM_STEP):
            seq = seqs[model_id] = seqs.get(model_id, 0) + 1
            body = (
                wire.ForwardBackward(model_id, seq, "cross_entropy", {}, False, datums)
                if kind is Kind.FORWARD_BACKWARD
                else AdamStep(learning_rate=LR)
            )
            work = Work(kind, state.futures.new(), "owner", model_id=model_id, seq_id=seq, body=body)
            ids.append(state.inbox.put(work))
        return ids

    for model_id in ("step:train:0", "inbox:train:0"):
        create(model_id)
    client = tinker.ServiceClient(base_url=server.url, api_key=key)
    tc = client.create_lora_training_client(
        base_model=model_dir, rank=rank, seed=0, train_unembed=False
    ).result()
    sdk = sdk_datums(rows)
    loop_steps: dict[str, list[int]] = {}

    def run_step() -> None:
        with gate:
            ids = put_step("step:train:0")
            assert own_step()
            for request_id in ids:
                result = state.futures.get(request_id)
                assert result is not None and result.error is None, result

    def run_inbox() -> None:
        for request_id in put_step("inbox:train:0"):
            settled(request_id)

    def run_http() -> None:
        sdk_step(tc, sdk)

    def counted(name: str, fn):
        def run() -> None:
            before = trainer.recorder.step
            fn()
            loop_steps.setdefault(name, []).append(trainer.recorder.step - before)

        return run

    fns = {"step": run_step, "inbox": run_inbox, "http": run_http}
    times = common.time_interleaved({k: counted(k, f) for k, f in fns.items()}, warmup=1, repeats=repeats)
    client.close("success").result()
    trainer.stop_requested = True
    loop_thread.join(60)
    server.stop()
    return dict(times=times, loop_steps=loop_steps)


def print_overhead(res: dict, cfg: dict, repeats: int) -> float:
    t, med = res["times"], common.median
    base = med([x.wall for x in t["step"]])
    base_cpu = med([x.cpu for x in t["step"]])
    labels = {
        "step": "in-process: requests into the inbox, Trainer.step() here",
        "inbox": "inbox + loop thread (train()) + futures, no HTTP",
        "http": "SDK over HTTP (loopback) + loop thread",
    }
    rows = []
    for name, label in labels.items():
        wall, cpu = med([x.wall for x in t[name]]), med([x.cpu for x in t[name]])
        steps = res["loop_steps"][name][1:]  # (timed calls only)
        rows.append(
            [
                label,
                f"{wall:.3f}",
                common.spread([x.wall for x in t[name]]),
                f"{cpu:.3f}",
                f"{med([x.contention for x in t[name]]):.2f}",
                f"{sum(steps) / len(steps):.2f}",
                f"{wall / base:.3f}",
                f"{cpu / base_cpu:.3f}",
            ]
        )
    print(
        f"## 1. one client's step ({cfg['rows']} rows x {cfg['tokens']} tokens: forward_backward + optim_step), "
        f"median of {repeats} interleaved repeats after 1 warm-up round\n"
    )
    common.print_table(
        [
            "",
            "wall s",
            "wall min–max",
            "CPU s",
            "others' cores",
            "loop steps per call",
            "wall ÷ in-process",
            "CPU ÷ in-process",
        ],
        rows,
    )
    ratio = med([x.wall for x in t["http"]]) / base
    print(
        f"\nRATIO step time, HTTP / in-process: {common.verdict(ratio, OVERHEAD_GOAL)}  "
        f"[http {med([x.wall for x in t['http']]):.3f} s vs in-process {base:.3f} s]\n",
        flush=True,
    )
    return ratio


# -- 2 and 3. served jobs (ml.serve) ---------------------------------------------------------------------


def proc_bytes(pid: int, field: str) -> int:
    """``field`` of ``/proc/<pid>/status`` in bytes: ``VmHWM`` (the peak RSS so far) or ``VmRSS`` (now)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} for pid {pid}")


def job_memory(svc, field: str) -> dict[str, int]:
    """``field`` (:func:`proc_bytes`) of each process of the served job: the torchrun agent, its worker."""
    agent = psutil.Process(svc.process.pid)
    workers = agent.children(recursive=True)
    assert workers, "the served job has no worker process"
    # (one worker: the service runs on one process)
    return {"agent": proc_bytes(agent.pid, field), "worker": sum(proc_bytes(w.pid, field) for w in workers)}


def job_cpu(svc) -> float:
    """CPU seconds the served job's processes (agent and worker, every thread) have used."""
    agent = psutil.Process(svc.process.pid)
    return sum(sum(p.cpu_times()[:2]) for p in [agent, *agent.children(recursive=True)])


class Clients:
    """``n`` SDK clients of the served job ``svc``, each a ``ServiceClient`` with its training client and
    its own rows, run in threads."""

    def __init__(self, svc, n: int, cfg: dict) -> None:
        self.datums = [
            sdk_datums(random_rows(cfg["rows"], cfg["tokens"], cfg["size"].vocab_size, seed=i))
            for i in range(n)
        ]
        self.tcs = [None] * n
        self.services = [svc.client() for _ in range(n)]

        def make(i: int) -> None:
            tc = self.services[i].create_lora_training_client(
                base_model=svc.base_model, rank=cfg["rank"], seed=i, train_unembed=False
            )
            self.tcs[i] = tc.result()
            sdk_step(self.tcs[i], self.datums[i])  # warm-up (untimed)

        self._all(make, range(n))

    def close(self) -> None:
        """End the clients' sessions (else their heartbeats go on after the job is stopped)."""
        for service in self.services:
            service.close("success").result()

    @staticmethod
    def _all(fn, which) -> None:
        errors: list[BaseException] = []

        def guarded(i: int) -> None:
            try:
                fn(i)
            except BaseException as e:  # re-raised below, in this thread
                errors.append(e)

        threads = [threading.Thread(target=guarded, args=(i,), daemon=True) for i in which]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]

    def run(self, which: list[int], steps: int) -> float:
        """Clients ``which`` each run ``steps`` steps, all starting together; the wall time to the last end."""
        barrier = threading.Barrier(len(which) + 1)

        def loop(i: int) -> None:
            barrier.wait()
            for _ in range(steps):
                sdk_step(self.tcs[i], self.datums[i])

        t0 = [0.0]

        def start() -> None:
            barrier.wait()
            t0[0] = time.perf_counter()

        starter = threading.Thread(target=start)
        starter.start()
        self._all(loop, which)
        starter.join()
        return time.perf_counter() - t0[0]


def serve_spec(model_dir: str, cfg: dict, max_tenants: int):
    import mlora_lab as ml

    # (max_step_tokens only when given: the script also runs on the commits before it, as a baseline)
    cap = {} if cfg["max_step_tokens"] is None else {"max_step_tokens": cfg["max_step_tokens"]}
    service = ml.Service(lora_alpha=2.0 * cfg["rank"], **cap)
    passes = {} if cfg["max_pass_tokens"] is None else {"max_pass_tokens": cfg["max_pass_tokens"]}
    return ml.JobSpec(
        base_model=model_dir,
        tenants=[],
        seq_len=cfg["tokens"] + 1,
        max_tenants=max_tenants,
        max_rank=cfg["rank"],
        slot_modules=common.LLAMA_TARGETS,
        service=service,
        **passes,
    )


def served_jobs(cfg: dict, model_dir: str, work: Path) -> dict:
    import mlora_lab as ml

    steps, rows = cfg["steps"], cfg["rows"]
    out: dict = {"one": [], "four": [], "singles": []}
    svc = ml.serve(serve_spec(model_dir, cfg, CLIENTS), workdir=work / "runs")
    try:
        t0 = time.perf_counter()
        _ = svc.base_url
        out["start_s"] = time.perf_counter() - t0
        out["up"] = job_memory(svc, "VmRSS")
        clients = Clients(svc, CLIENTS, cfg)
        steps_before = len(svc.system_metrics())

        def phase(which: list[int]) -> dict:
            time.sleep(0.5)  # (the job writes a step's system row just after its results are sent)
            n0 = len(svc.system_metrics())
            b0, j0, c0 = common.machine_busy_seconds(), job_cpu(svc), time.process_time()
            wall = clients.run(which, steps)
            job, ours = job_cpu(svc) - j0, time.process_time() - c0
            done = len(which) * steps * rows
            others = max(common.machine_busy_seconds() - b0 - job - ours, 0.0) / wall
            time.sleep(0.5)
            stepping = float(svc.system_metrics()["step_time"].iloc[n0:].sum())  # the loop's steps, in s
            return dict(
                wall=wall,
                rows_s=done / wall,
                job_cpu=job,
                rows_cpu=done / job,
                others=others,
                busy=stepping / wall,
            )

        for r in range(cfg["rounds"]):
            print(f"  round {r + 1}/{cfg['rounds']}: 1 client, then {CLIENTS} ... ({clock()})", flush=True)
            out["one"].append(phase([0]))
            out["four"].append(phase(list(range(CLIENTS))))
        out["peaks"] = job_memory(svc, "VmHWM")
        clients.close()
        system = svc.system_metrics()
        out["system_peak"] = int(system["peak_mem_bytes"].max())
        system = system.iloc[steps_before:]
        out["tenants_per_step"] = system["tenants"].tolist()
        out["step_time"] = system["step_time"].tolist()
    finally:
        svc.stop()
    # the one-client jobs start together (their start-ups overlap), then each serves its client alone
    print(f"  {CLIENTS} one-client jobs ... ({clock()})", flush=True)
    singles = []
    try:
        singles = [ml.serve(serve_spec(model_dir, cfg, 1), workdir=work / "runs") for _ in range(CLIENTS)]
        for single in singles:
            _ = single.base_url
        for single in singles:
            up = job_memory(single, "VmRSS")
            clients = Clients(single, 1, cfg)
            wall = clients.run([0], steps)
            out["singles"].append(dict(rows_s=steps * rows / wall, up=up, peaks=job_memory(single, "VmHWM")))
            clients.close()
    finally:
        print(f"  stopping them ... ({clock()})", flush=True)
        stoppers = [threading.Thread(target=single.stop) for single in singles]  # (together: each waits)
        for t in stoppers:
            t.start()
        for t in stoppers:
            t.join()
    print(f"  done ({clock()})\n", flush=True)
    return out


def print_served(res: dict, cfg: dict) -> tuple[float, float]:
    med, mib = common.median, common.mib
    one, four = med([r["rows_s"] for r in res["one"]]), med([r["rows_s"] for r in res["four"]])
    print(
        f"## 2. four SDK clients at once vs one, on one served job (ml.serve; {cfg['steps']} steps per client "
        f"per round, {cfg['rounds']} round(s), median over rounds; the job up {res['start_s']:.1f} s after "
        f"ml.serve)\n"
    )

    def each(runs: list[dict], key: str, fmt: str = ".2f") -> str:
        return " ".join(f"{r[key]:{fmt}}" for r in runs)

    rows = []
    for name, label, k in (("one", "1 client", 1), ("four", f"{CLIENTS} clients at once", CLIENTS)):
        runs = res[name]
        rows.append(
            [
                label,
                f"{k * cfg['steps'] * cfg['rows']}",
                each(runs, "wall"),
                each(runs, "rows_s"),
                f"{med([r['rows_s'] for r in runs]):.2f}",
                each(runs, "rows_cpu"),
                f"{med([r['rows_cpu'] for r in runs]):.2f}",
                each(runs, "busy"),
                each(runs, "others"),
            ]
        )
    single = med([s["rows_s"] for s in res["singles"]])
    rows.append(
        [
            f"(1 client on its own 1-slot job, {CLIENTS} jobs)",
            f"{cfg['steps'] * cfg['rows']}",
            "",
            each(res["singles"], "rows_s"),
            f"{single:.2f}",
            "",
            "",
            "",
            "",
        ]
    )
    common.print_table(
        [
            "",
            "rows per round",
            "wall s per round",
            "rows/s per round",
            "rows/s (median)",
            "rows per job CPU s, per round",
            "(median)",
            "loop stepping",
            "others' cores",
        ],
        rows,
    )
    per_round = [f["rows_s"] / o["rows_s"] for o, f in zip(res["one"], res["four"])]
    by_cpu = med([r["rows_cpu"] for r in res["four"]]) / med([r["rows_cpu"] for r in res["one"]])
    print(
        f"\n(rows/s ratio per round: {' '.join(f'{x:.3f}' for x in per_round)}; rows per CPU second of the job "
        f"(every thread of its processes), {CLIENTS} clients / 1: {by_cpu:.3f})"
    )
    tenants, times = res["tenants_per_step"], res["step_time"]
    by_tenants: dict[int, list[float]] = {}
    for n, s in zip(tenants, times):
        by_tenants.setdefault(int(n), []).append(s)
    detail = ", ".join(
        f"{n} tenant(s): {len(v)} steps, median {med(v):.3f} s" for n, v in sorted(by_tenants.items())
    )
    print(f"(the job's own system rows during the rounds: {detail})")
    ratio = four / one
    print(
        f"\nRATIO rows/s, {CLIENTS} clients / 1: {at_least(ratio, CLIENTS_GOAL)}  [{four:.2f} vs {one:.2f} rows/s; "
        f"by the job's CPU time {by_cpu:.3f}]\n"
    )

    print(
        f"## 3. peak RSS: one served job with {CLIENTS} clients vs {CLIENTS} served jobs with 1 client each\n"
    )
    a, a_up = res["peaks"], res["up"]
    singles, singles_up = [s["peaks"] for s in res["singles"]], [s["up"] for s in res["singles"]]

    def both(m: dict[str, int]) -> int:
        return m["agent"] + m["worker"]

    total_a, total_s = both(a), sum(both(p) for p in singles)
    worker_s = sum(p["worker"] for p in singles)
    up_a, up_s = both(a_up), sum(both(u) for u in singles_up)
    above_a = a["worker"] - a_up["worker"]
    above_s = sum(p["worker"] - u["worker"] for p, u in zip(singles, singles_up))
    common.print_table(
        [
            "",
            f"1 job, {CLIENTS} clients",
            f"{CLIENTS} jobs, 1 client each (sum)",
            "ratio",
            "each 1-client job",
        ],
        [
            [
                "**peak RSS, job processes (torchrun agent + worker)**",
                mib(total_a),
                mib(total_s),
                f"**{total_a / total_s:.3f}**",
                " ".join(mib(both(p)) for p in singles),
            ],
            [
                "  worker",
                mib(a["worker"]),
                mib(worker_s),
                f"{a['worker'] / worker_s:.3f}",
                " ".join(mib(p["worker"]) for p in singles),
            ],
            [
                "  torchrun agent",
                mib(a["agent"]),
                mib(sum(p["agent"] for p in singles)),
                "",
                " ".join(mib(p["agent"]) for p in singles),
            ],
            [
                "RSS when up, before any client (agent + worker)",
                mib(up_a),
                mib(up_s),
                f"{up_a / up_s:.3f}",
                " ".join(mib(both(u)) for u in singles_up),
            ],
            [
                "worker's peak above that (the clients' steps)",
                mib(above_a),
                mib(above_s),
                f"{above_a / above_s:.3f}",
                " ".join(mib(p["worker"] - u["worker"]) for p, u in zip(singles, singles_up)),
            ],
        ],
    )
    print(f"\n(the 4-client job's own system rows: peak {mib(res['system_peak'])}, its worker's ru_maxrss)")
    mem_ratio = total_a / total_s
    print(
        f"\nRATIO peak RSS, 1 job with {CLIENTS} clients / {CLIENTS} one-client jobs: "
        f"{common.verdict(mem_ratio, MEM_GOAL)}  [{mib(total_a)} vs {mib(total_s)}; workers only "
        f"{a['worker'] / worker_s:.3f}]"
    )
    return ratio, mem_ratio


_T0 = time.perf_counter()


def clock() -> str:
    """Seconds since the script started, for the progress lines."""
    return f"{time.perf_counter() - _T0:.0f} s"


def at_least(value: float, goal: float) -> str:
    return f"{value:.3f} (goal >= {goal:.2f}: {'MET' if value >= goal else 'MISSED'})"


def main() -> None:
    parser = common.bench_parser(__doc__, "tiny model, few rows and steps (smoke test)")
    parser.add_argument("--repeats", type=int, default=None, help="timed repeats of part 1")
    parser.add_argument("--part", choices=["all", "overhead", "clients"], default="all")
    parser.add_argument(
        "--max-step-tokens",
        type=int,
        default=None,
        help="the served jobs' Service.max_step_tokens (parts 2 and 3; default: none)",
    )
    parser.add_argument(
        "--max-pass-tokens",
        type=int,
        default=None,
        help="the served jobs' JobSpec.max_pass_tokens (parts 2 and 3; default: a served job's, 1,024 on a CPU)",
    )
    args = parser.parse_args()
    cfg = dict(
        QUICK if args.quick else FULL,
        max_step_tokens=args.max_step_tokens,
        max_pass_tokens=args.max_pass_tokens,
    )
    common.setup(args.threads)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the served jobs' processes inherit it
    load_before = common.wait_for_quiet(0 if args.quick else args.max_wait)
    with tempfile.TemporaryDirectory(prefix="mlora_bench_") as tmp_name:
        tmp = Path(tmp_name)
        model_dir = common.build_model(tmp / "model", cfg["size"])
        print("\n# service: the Tinker API's overhead, 4 clients vs 1, memory (issue 24)\n")
        print(common.machine_line())
        print(
            f"threads: torch.set_num_threads({args.threads}) here, OMP_NUM_THREADS={args.threads} in the jobs"
        )
        print(
            f"model: {cfg['size'].describe(common.n_params(model_dir))}; LoRA rank {cfg['rank']}, alpha "
            f"{2 * cfg['rank']}, all 7 projections; fp32; a client's step: {cfg['rows']} rows x "
            f"{cfg['tokens']} tokens"
        )
        print(
            f"served jobs (parts 2 and 3): Service(max_step_tokens={args.max_step_tokens}), "
            f"JobSpec(max_pass_tokens={args.max_pass_tokens})"
        )
        print(f"other processes kept {load_before:.2f} cores busy before the run\n", flush=True)
        if args.part in ("all", "overhead"):
            repeats = args.repeats or cfg["repeats"]
            print_overhead(overhead(cfg, model_dir, repeats), cfg, repeats)
        if args.part in ("all", "clients"):
            print_served(served_jobs(cfg, model_dir, tmp), cfg)


if __name__ == "__main__":
    main()
