"""Saved training states of the service's tenants: ``save_state``, ``load_state``, a client from a state.

Part of the service driver (:class:`~mlora_lab.job.drivers.tinker.driver.ServiceDriver`), which hands this module the
``save_weights`` and ``load_weights`` requests of its models at their place in each model's ``seq_id``
order, and settles the answers it gets back:

    save_weights      ``save_state``: ``<checkpoints>/weights/<model>/<name>/`` in the checkpoint format (JSON
                      + safetensors, never a pickle; complete or absent), holding the adapter, the AdamW
                      state and the client's LoRA settings, and ``adapter/`` beside them, a PEFT adapter
                      directory; answered ``tinker://<model>/weights/<name>``
    load_weights      into the model (``load_state``: the weights, a fresh AdamW; ``..._with_optimizer``:
                      its state too), or a new model from it (``create_training_client_from_state``:
                      the load is that model's first request)

On several processes a saved state's tensors are gathered on every process (``TensorIO``) and written by
rank 0 alone; rank 0 reads a state and broadcasts it (or why it cannot be read), and says whether a save may
go ahead (its folder exists already or not), so a request fails alike on every process.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from mlora_lab.job.engine import Engine
from mlora_lab.job.tenants import TenantRun
from mlora_lab.rundir import checkpoint
from mlora_lab.rundir.checkpoint import CheckpointError, read_checkpoint, write_state_dir
from mlora_lab.rundir.service import saved_folder
from mlora_lab.service.bodies import ModelInfo
from mlora_lab.service.work import ErrorCategory, Result, Work

STATE_FORMAT = "mlora_lab.service.state/1"
"""What a saved Tinker state says it is (a checkpoint-format directory of another kind is refused)."""


class SavedStates:
    """Saving and loading the training state of ``engine``'s tenants in ``checkpoints`` (the service folder;
    None: this server keeps no saved states). ``main``: whether this is rank 0, which reads and writes the
    files; ``lora_alpha``: the job's alpha, saved with the client's LoRA settings.

    Requests are answered with a :class:`~mlora_lab.service.work.Result` for the caller to settle (rank 0
    holds the futures)."""

    def __init__(self, engine: Engine, checkpoints: Path | None, main: bool, lora_alpha: float) -> None:
        self.engine, self.comm = engine, engine.comm
        self.checkpoints, self.main, self.lora_alpha = checkpoints, main, lora_alpha

    def folder(self, path: str) -> Path | None:
        """Where the checkpoint ``path`` (``tinker://…``) lives (None: this server saves nothing)."""
        return None if self.checkpoints is None else saved_folder(self.checkpoints, path)

    def save(self, work: Work, t: TenantRun, info: ModelInfo | None) -> Result | None:
        """``save_state`` of ``t``, the model ``info`` describes (rank 0 knows it; None elsewhere): its
        answer, on rank 0 (None elsewhere once the tensors are gathered, or the refusal every process
        shares)."""
        save = work.body
        path = f"tinker://{work.model_id}/weights/{save.name}"
        folder = self.folder(path)
        refusal = None
        if folder is None:
            refusal = "this server keeps no saved states (it runs without a run directory)"
        elif self.main and folder.exists() and not save.overwrite:
            refusal = f"{path} exists already (save with overwrite=True to replace it)"
        if folder is not None:  # (rank 0 sees the folder: every process refuses with it, or gathers with it)
            refusal = self.comm.broadcast_object(refusal)
        if refusal is not None:
            return Result(error=str(refusal))
        io = self.engine.model.io
        adapter = self.engine.model.tenant_tensors(t.name)  # (gathers: collectives)
        optimizer = t.optimizer.state_dict(gather=io.gather)
        if not self.main:
            return None
        assert info is not None
        lora = {k: getattr(info, k) for k in ("rank", "seed", "train_attn", "train_mlp", "train_unembed")}
        tree = {
            "format": STATE_FORMAT,
            "model_id": work.model_id,
            "lora": {**lora, "alpha": self.lora_alpha},
            "adapter": adapter,
            "optimizer": optimizer,
            "step": t.step,
        }

        def peft_folder(tmp: Path) -> None:
            self.engine.model.save_adapter(t.name, tmp / "adapter", self.engine.base_path, tensors=adapter)

        try:
            write_state_dir(folder, t.step, tree, beside=peft_folder, root=self.checkpoints.parent)
        except checkpoint.WRITE_ERRORS as e:
            return Result(error=f"could not save {path}: {e}", category=ErrorCategory.SERVER)
        return Result(json={"path": path, "type": "save_weights"})

    def read(self, path: str) -> dict[str, Any] | str:
        """The saved state at ``path``, read by rank 0 and broadcast, or why it cannot be read (then the
        request fails alike on every process)."""
        state: dict[str, Any] | str | None = None
        if self.main:
            folder = self.folder(path)
            try:
                if folder is None or not folder.exists():
                    raise CheckpointError(f"no saved state {path} on this server")
                state = read_checkpoint(folder, root=self.checkpoints.parent)  # (through no link in the run)
                if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
                    raise CheckpointError(f"{path} is not a saved state of this service")
            except (CheckpointError, ValueError, OSError) as e:  # (rank 0 must reach the broadcast)
                state = str(e)
        return self.comm.broadcast_object(state)  # type: ignore[return-value]

    def load(self, work: Work, t: TenantRun) -> Result:
        """``load_state``: the saved weights (and, asked, the AdamW state; else a fresh one) into ``t``."""
        state = self.read(work.body.path)
        if isinstance(state, str):
            return Result(error=state)
        mine = self.engine.model.tenant_tensors(t.name)
        theirs = state["adapter"]
        if set(mine) != set(theirs) or any(mine[k][0].shape != theirs[k][0].shape for k in mine):
            return Result(error=f"{work.body.path} has another LoRA shape (rank or layers) than this model")
        self.restore(t, state, work.body.optimizer)
        return Result(json={"path": work.body.path, "type": "load_weights"})

    def create_from(
        self, work: Work, create: Callable[[Work, ModelInfo], TenantRun | None], base_model: str
    ) -> Result | None:
        """``create_training_client_from_state``: a new model with the saved LoRA settings (``create``
        makes it, or fails the request and gives None: then None), then the load into it; its answer."""
        try:
            state = self.read(work.body.path)
        except ValueError as e:  # (not a checkpoint path: the request fails alone, alike on every process)
            state = str(e)
        if isinstance(state, str):
            return Result(error=state)
        t = create(work, saved_model(work, state, base_model))
        if t is None:
            return None
        self.restore(t, state, work.body.optimizer)
        return Result(json={"path": work.body.path, "type": "load_weights", "model_id": work.model_id})

    def restore(self, t: TenantRun, state: dict[str, Any], optimizer: bool) -> None:
        """A read state's weights into ``t``, and its AdamW state if ``optimizer`` (else a fresh AdamW)."""
        self.engine.model.set_tenant_tensors(t.name, state["adapter"])
        t.optimizer.zero_grad()
        if optimizer:
            t.optimizer.load_state_dict(state["optimizer"], scatter=self.engine.model.io.scatter)
        else:
            t.optimizer.optimizer.state.clear()  # AdamW starts again: no moments, step 0


def saved_model(work: Work, state: dict[str, Any], base_model: str) -> ModelInfo:
    """The model ``create_training_client_from_state`` (``work``) makes: the saved LoRA settings of
    ``state``, the id and owner the request gives."""
    lora = state["lora"]
    return ModelInfo(
        work.model_id,
        work.body.owner,
        base_model,
        int(lora["rank"]),
        lora["seed"],
        bool(lora["train_attn"]),
        bool(lora["train_mlp"]),
        bool(lora["train_unembed"]),
        name=work.body.name,
    )
