"""Agent tenants (issue 51): 4 tool-using agent tenants in one job vs 4 single-tenant jobs of the same envs.

    .venv/bin/python benchmarks/agents.py           # full run (~3 min on a quiet 2-core machine)
    .venv/bin/python benchmarks/agents.py --quick   # smoke test (~1 min; numbers mean little)

Each agent tenant has an env (``rl.env``, a rollout function) that plays ``TURNS`` turns per episode: a model
turn through the job's endpoint, then a tool that sleeps ``TOOL_S`` = 0.2 s (as real tools and sandboxes take
time), whose result is the next user message. The four tenants' envs differ only in their words and their
reward. Each run is an **in-process** job (``Trainer(JobSpec(...)).train()``, the loop a launched job runs, without
torchrun's start-up) in its own child process, imports done before the clock starts:

- **one job, 4 tenants**: every tenant's episodes run at once (one env worker each); the turns that wait at
  the same moment, of every tenant, are sampled in one batched generation, and one tenant's tool time hides
  behind the others' generation and tools;
- **4 jobs, 1 tenant each**, one after another: the same tenants, each alone.

Reported: **turns per second** (model turns answered ÷ the training loop's wall time, set-up excluded on both
sides), their ratio (goal ≥ 2 on CPU), and in the 4-tenant job the **share of its episode time spent waiting on
tools while no generation runs** (the time of ``Rollouts.play`` less its ``sample`` calls, over the time of
``Rollouts.play``): what the asynchronous RL issue (rollouts on their own ranks, training during tools) is to cut.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common

RATIO_GOAL = 2.0  # turns/s of 4 tenants in one job ÷ 4 single-tenant jobs: at least
TOOL_S = 0.2
TURNS = 3
NAMES = ["alpha", "bravo", "charlie", "delta"]

FULL = dict(size=common.ModelSize(256, 4, 4, 2, 2048), rank=8, steps=4, batch=2, group=2, new_tokens=16)
QUICK = dict(size=common.ModelSize(128, 2, 4, 2, 1024), rank=4, steps=2, batch=1, group=2, new_tokens=8)

ENV = f'''
import time

def play(client, model, example, word):
    """{TURNS} turns: the model answers, a tool sleeps {TOOL_S} s and its result is the next message."""
    messages = list(example["messages"])
    said = 0
    for turn in range({TURNS}):
        answer = client.chat.completions.create(model=model, messages=messages).choices[0].message.content
        messages.append({{"role": "assistant", "content": answer}})
        said += answer.count(word)
        time.sleep({TOOL_S})  # the tool
        if turn + 1 < {TURNS}:
            messages.append({{"role": "user", "content": f"the tool found {{len(answer)}} letters; again"}})
    return {{"reward": float(said), "metrics": {{"letters": float(len(answer))}}}}
'''


def write_inputs(tmp: Path, rows: int) -> tuple[str, str]:
    env = tmp / "agent_env.py"
    env.write_text(ENV)
    lines = [
        json.dumps({"messages": [{"role": "user", "content": f"tell me about the {w} number {i}"}]})
        for i, w in enumerate(
            ["red", "green", "blue", "cat", "dog", "bird", "tree", "river"] * (rows // 8 + 1)
        )
    ][:rows]
    data = tmp / "prompts.jsonl"
    data.write_text("\n".join(lines) + "\n")
    return str(env), str(data)


# -- one run (a child process) ------------------------------------------------------------------------------


def worker(payload: str) -> None:
    p = json.loads(payload)
    common.setup(p["threads"])
    import mlora_lab.agents.rollouts as rollouts
    from mlora_lab.job.drivers.files import FileData
    from mlora_lab.job.drivers.rl import RLDriver
    from mlora_lab.job.trainer import Trainer
    from mlora_lab.rundir import RowKind
    from mlora_lab.spec.job import JobSpec
    from mlora_lab.spec.parts import RL
    from mlora_lab.spec.tenant import Tenant

    spent = {"sample": 0.0, "play": 0.0, "waves": 0}
    sample, play = rollouts.sample, rollouts.Rollouts.play

    def timed_sample(*a, **kw):
        t0 = time.perf_counter()
        try:
            return sample(*a, **kw)
        finally:
            spent["sample"] += time.perf_counter() - t0
            spent["waves"] += 1

    def timed_play(self, *a, **kw):
        t0 = time.perf_counter()
        try:
            return play(self, *a, **kw)
        finally:
            spent["play"] += time.perf_counter() - t0

    rollouts.sample, rollouts.Rollouts.play = timed_sample, timed_play
    words = ["the", "a", "and", "of"]
    tenants = [
        Tenant(
            name=name,
            data=p["data"],
            rl=RL(
                env=f"{p['env']}:play",
                env_args={"word": words[NAMES.index(name)]},
                group_size=p["group"],
                max_new_tokens=p["new_tokens"],
                rollout_timeout_s=600,
            ),
            rank=p["rank"],
            alpha=2 * p["rank"],
            target_modules=common.LLAMA_TARGETS,
            lr=1e-3,
            batch_size=p["batch"],
            max_steps=p["steps"],
            seed=NAMES.index(name),
        )
        for name in p["tenants"]
    ]
    spec = JobSpec(base_model=p["model"], tenants=tenants, seq_len=256, max_rank=16, max_tenants=4)
    t0 = time.perf_counter()
    trainer = Trainer(spec, drivers=(RLDriver, FileData))
    setup_s = time.perf_counter() - t0
    try:
        timing = common.time_once(trainer.train)
    finally:
        trainer.close()
    rows = [r for r in trainer.history if r["kind"] == RowKind.TRAIN]
    episodes = p["batch"] * p["group"]
    turns = sum(r["extra"]["agent/turns"] * episodes for r in rows)
    states = {name: trainer.tenants[name].state.value for name in p["tenants"]}
    common.report_to_parent(
        dict(
            setup_s=setup_s,
            wall=timing.wall,
            cpu=timing.cpu,
            others=timing.contention,
            turns=turns,
            play=spent["play"],
            sample=spent["sample"],
            waves=spent["waves"],
            states=states,
        )
    )


# -- the benchmark ------------------------------------------------------------------------------------------


def main() -> None:
    parser = common.bench_parser(__doc__, "tiny model, few steps (smoke test)")
    args = parser.parse_args()
    if args.worker:
        worker(args.worker)
        return
    cfg = QUICK if args.quick else FULL
    common.setup(args.threads)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the children inherit it
    load_before = common.wait_for_quiet(0 if args.quick else args.max_wait)
    with tempfile.TemporaryDirectory(prefix="mlora_bench_agents_") as tmp_name:
        tmp = Path(tmp_name)
        model_dir = common.build_model(tmp / "model", cfg["size"])
        env, data = write_inputs(tmp, cfg["batch"] * cfg["steps"] * 2)
        print(
            f"\n# agents: {len(NAMES)} agent tenants in one job vs {len(NAMES)} single-tenant jobs (issue 51)\n"
        )
        print(common.machine_line())
        print(
            f"threads: torch.set_num_threads({args.threads}) and OMP_NUM_THREADS={args.threads} in every process"
        )
        print(
            f"model: {cfg['size'].describe(common.n_params(model_dir))}; LoRA rank {cfg['rank']}, all 7 projections"
        )
        print(
            f"each tenant: {cfg['steps']} steps of {cfg['batch']} prompts x {cfg['group']} episodes, {TURNS} turns "
            f"each (at most {cfg['new_tokens']} new tokens), a tool of {TOOL_S} s after each turn"
        )
        print(f"other processes kept {load_before:.2f} cores busy before the run\n", flush=True)
        shared = dict(
            model=model_dir,
            env=env,
            data=data,
            threads=args.threads,
            **{k: cfg[k] for k in cfg if k != "size"},
        )
        print("  one job, 4 tenants ...", flush=True)
        together = common.run_child(__file__, dict(shared, tenants=NAMES)).result
        alone = []
        for name in NAMES:
            print(f"  one job, tenant {name} alone ...", flush=True)
            alone.append(common.run_child(__file__, dict(shared, tenants=[name])).result)

    for r in [together, *alone]:
        assert all(s == "finished" for s in r["states"].values()), r["states"]
        assert r["turns"] > 0
    alone_turns, alone_wall = sum(r["turns"] for r in alone), sum(r["wall"] for r in alone)
    rate_together, rate_alone = together["turns"] / together["wall"], alone_turns / alone_wall
    ratio = rate_together / rate_alone
    waiting = 1 - together["sample"] / together["play"]
    print("\n## turns per second (the training loop's wall time; set-up excluded)\n")
    common.print_table(
        ["", "turns", "wall s", "CPU s", "turns/s", "others' cores"],
        [
            ["4 tenants, one job", f"{together['turns']:.0f}", f"{together['wall']:.1f}", f"{together['cpu']:.1f}",
             f"{rate_together:.2f}", f"{together['others']:.2f}"],
            ["4 jobs of 1 tenant", f"{alone_turns:.0f}", f"{alone_wall:.1f}", f"{sum(r['cpu'] for r in alone):.1f}",
             f"{rate_alone:.2f}", f"{max(r['others'] for r in alone):.2f}"],
        ],
    )  # fmt: skip
    print(f"\nratio (one job / separate jobs): {ratio:.2f} (goal >= {RATIO_GOAL:.1f}: "
          f"{'MET' if ratio >= RATIO_GOAL else 'MISSED'})")  # fmt: skip
    print(
        f"4-tenant job: episodes took {together['play']:.1f} s, of which generation {together['sample']:.1f} s: "
        f"{100 * waiting:.0f}% of the episode time waited on tools with no generation running"
    )
    print(
        f"generations (waves of turns): {together['waves']} in the 4-tenant job ({together['turns'] / together['waves']:.1f} "
        f"turns each), {sum(r['waves'] for r in alone)} in the 4 single-tenant jobs"
    )
    single = [1 - r["sample"] / r["play"] for r in alone]
    print(
        f"single-tenant jobs: {100 * common.median(single):.0f}% (median) of their episode time waited on tools"
    )


if __name__ == "__main__":
    main()
