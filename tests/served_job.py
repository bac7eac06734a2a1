"""A job served on this process, for the tests that drive it with the official Tinker SDK (0.38.0): its
training loop on a thread (or stepped by the test), its Tinker service on loopback.

    served = Served(llama_path, checkpoints=tmp_path / "service")
    tc = served.client().create_lora_training_client(base_model=served.base, rank=4).result()
    ...
    served.close()
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import tinker

from mlora_lab.job.drivers.files import FileData
from mlora_lab.job.drivers.rl import RLDriver
from mlora_lab.job.drivers.tinker.driver import ServiceDriver
from mlora_lab.job.trainer import Trainer
from mlora_lab.service import wire
from mlora_lab.service.app import Server
from mlora_lab.service.keys import Keys
from mlora_lab.service.state import ServiceState
from mlora_lab.service.work import Futures, Inbox
from mlora_lab.spec.job import JobSpec
from mlora_lab.spec.parts import Service

SLOTS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class Served:
    """A job on this process, its training loop on a thread, its service on loopback."""

    def __init__(
        self,
        base: str,
        max_tenants: int = 2,
        background: bool = True,
        checkpoints: Path | None = None,
        seq_len: int = 48,
        session_timeout_s: float = 30.0,
        idle_s: float = 0.5,
        max_step_tokens: int | None = None,
        slot_modules: list[str] | None = None,
        quantize: str | None = None,
        log_every: int = 1,
        tenants: list | None = None,
        max_queue: int = 4096,
        run_dir: Path | None = None,
    ) -> None:
        self.base = base
        spec = JobSpec(
            quantize=quantize,
            log_every=log_every,
            base_model=base,
            tenants=list(tenants or []),
            seq_len=seq_len,
            max_tenants=max_tenants,
            max_rank=8,
            slot_modules=slot_modules,  # (None: a served job's default, what a default client trains)
            service=Service(),  # (what makes a served job: e.g. the packed experts of an MoE get slots)
        )
        self.keys = Keys()
        self.key = self.keys.add("owner")
        self.state = ServiceState(
            inbox=Inbox(capacity=max_queue),
            futures=Futures(),
            keys=self.keys,
            base_model=base,
            limits=wire.Limits(vocab_size=1, max_tokens=1),
            max_rank=8,
            tokenizer_id=base,
            checkpoints=checkpoints,
        )
        self.trainer = Trainer(
            spec,
            run_dir,  # (None: no run directory, nothing written)
            drivers=(
                lambda parts: ServiceDriver(
                    parts,
                    self.state,
                    checkpoints=checkpoints,
                    session_timeout_s=session_timeout_s,
                    max_step_tokens=max_step_tokens,
                ),
                RLDriver,
                FileData,
            ),
        )
        # (a datum is its input tokens and one more position: seq_len - 1 input tokens at most)
        self.state.limits = wire.Limits(
            vocab_size=self.trainer.engine.vocab_rows, max_tokens=spec.seq_len - 1
        )
        self.server = Server(self.state).start()
        self.thread = None
        if background:
            self.thread = threading.Thread(target=self.trainer.train, kwargs={"idle_s": idle_s}, daemon=True)
            self.thread.start()

    def step_while(self, going, batch: int = 1, timeout: float = 120.0) -> None:
        """Without the background loop: step whenever ``batch`` requests wait (or any wait and none came
        for a second), or the driver holds requests a step left for the next, while ``going()``."""
        deadline, last = time.monotonic() + timeout, time.monotonic()
        driver = self.trainer.drivers.all[0]
        while going() and time.monotonic() < deadline:
            waiting = len(self.state.inbox)
            left = any(driver.requests.queues.values())  # (max_step_tokens: taken, not run yet)
            if waiting >= batch or left or (waiting and time.monotonic() - last > 1.0):
                self.trainer.step()
                last = time.monotonic()
            else:
                time.sleep(0.002)

    def client(self, key: str | None = None, **kwargs) -> tinker.ServiceClient:
        return tinker.ServiceClient(base_url=self.server.url, api_key=key or self.key, **kwargs)

    def tenant(self, model_id: str) -> str:
        """The name of the tenant a client's model is."""
        return self.trainer.drivers.all[0].tenant_of(model_id)

    def close(self) -> None:
        self.trainer.stop_requested = True
        self.trainer.wake.set()  # (out of its idle wait)
        if self.thread is not None:
            self.thread.join(60)
        self.server.stop()
