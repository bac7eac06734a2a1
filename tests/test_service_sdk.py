"""The official Tinker SDK (0.38.0) drives a job's tenants through the service, unchanged, on loopback.

Supervised exactness: the SDK's ``forward_backward(cross_entropy)`` in two chunks, then ``optim_step`` with
AdamParams, for several steps, equals plain PEFT + ``torch.optim.AdamW`` (decoupled weight decay, torch's
clipping) from the same initial adapter: the losses, every datum's per-token logprobs and the adapter.
"""

from __future__ import annotations

import threading
from pathlib import Path

import peft
import pytest
import torch
import transformers

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

from mlora_lab.job.filedata import FileData  # noqa: E402
from mlora_lab.job.rl import RLDriver  # noqa: E402
from mlora_lab.job.service import ServiceDriver  # noqa: E402
from mlora_lab.job.trainer import Trainer  # noqa: E402
from mlora_lab.reference import peft_lora_tensors  # noqa: E402
from mlora_lab.service import wire  # noqa: E402
from mlora_lab.service.app import Server, ServiceState  # noqa: E402
from mlora_lab.service.keys import Keys  # noqa: E402
from mlora_lab.service.work import Futures, Inbox  # noqa: E402
from mlora_lab.spec import JobSpec  # noqa: E402

TOL = 1e-5
SLOTS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TEXTS = ["the red cat sat on the road", "a blue bird and a green tree", "count the river city car", "dog"]


class Served:
    """A job on this process, its training loop on a thread, its service on loopback."""

    def __init__(self, base: str, max_tenants: int = 2) -> None:
        spec = JobSpec(base_model=base, tenants=[], seq_len=48, max_tenants=max_tenants, max_rank=8,
                       slot_modules=[*SLOTS, "lm_head"])  # fmt: skip
        self.keys = Keys()
        self.key = self.keys.add("owner")
        self.state = ServiceState(inbox=Inbox(), futures=Futures(), keys=self.keys, base_model=base,
                                  limits=wire.Limits(vocab_size=1, max_tokens=1), max_rank=8, tokenizer_id=base)  # fmt: skip
        self.trainer = Trainer(
            spec, drivers=(lambda parts: ServiceDriver(parts, self.state), RLDriver, FileData)
        )
        # (a datum is its input tokens and one more position: seq_len - 1 input tokens at most)
        self.state.limits = wire.Limits(
            vocab_size=self.trainer.engine.vocab_rows, max_tokens=spec.seq_len - 1
        )
        self.server = Server(self.state).start()
        self.thread = threading.Thread(target=self.trainer.train, kwargs={"idle_s": 0.005}, daemon=True)
        self.thread.start()

    def client(self, key: str | None = None) -> tinker.ServiceClient:
        return tinker.ServiceClient(base_url=self.server.url, api_key=key or self.key)

    def close(self) -> None:
        self.trainer.stop_requested = True
        self.thread.join(60)
        self.server.stop()


@pytest.fixture
def served(llama_path):
    s = Served(llama_path)
    yield s
    s.close()


def datums(tok, texts: list[str]) -> list[tuple[list[int], list[int], list[float]]]:
    """(input x [N], targets y [N], weights [N]) per text: y is x shifted by one; the first half of the
    positions weigh 0, the rest 1 (one weighs -0.5: any real weight is a cross-entropy weight)."""
    out = []
    for text in texts:
        ids = tok(text).input_ids
        x, y = ids[:-1], ids[1:]
        w = [0.0] * (len(x) // 2) + [1.0] * (len(x) - len(x) // 2)
        w[-1] = -0.5 if len(w) > 2 else w[-1]
        out.append((x, y, w))
    return out


def to_sdk(d: tuple[list[int], list[int], list[float]]) -> types.Datum:
    x, y, w = d
    return types.Datum(
        model_input=types.ModelInput.from_ints(x), loss_fn_inputs={"target_tokens": y, "weights": w}
    )


def test_sdk_forward_backward_in_chunks_and_optim_steps_equal_peft_and_adamw(served, llama_path, tmp_path):
    tok = transformers.AutoTokenizer.from_pretrained(llama_path)
    data = datums(tok, TEXTS)
    tc = served.client().create_lora_training_client(
        base_model=llama_path, rank=4, seed=7, train_unembed=False
    )
    name = tc.model_id.replace(":", "-")
    init = Path(served.trainer.engine.save_adapter(name, tmp_path / "init"))  # (the loop idles: no request)
    # (Adam's eps 1e-4: gradient entries that are rounding noise (~1e-10) are divided by eps; at 1e-8 and
    # lr 2e-2 that alone moved the adapters by 3e-5 between two exact computations, losses equal to 1e-5)
    adam = types.AdamParams(
        learning_rate=2e-2, beta1=0.9, beta2=0.95, eps=1e-4, weight_decay=0.01, grad_clip_norm=0.5
    )
    got_losses, got_logprobs, norms = [], [], []
    for _ in range(3):
        first = tc.forward_backward([to_sdk(d) for d in data[:2]], "cross_entropy")
        second = tc.forward_backward([to_sdk(d) for d in data[2:]], "cross_entropy")
        step = tc.optim_step(adam)
        a, b = first.result(), second.result()
        norms.append(step.result().metrics["grad_norm:max"])
        got_losses.append(a.metrics["loss:sum"] + b.metrics["loss:sum"])
        got_logprobs.append([o["logprobs"].to_torch() for o in (*a.loss_fn_outputs, *b.loss_fn_outputs)])

    base = transformers.AutoModelForCausalLM.from_pretrained(llama_path)
    model = peft.PeftModel.from_pretrained(base, str(init), is_trainable=True)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=2e-2, betas=(0.9, 0.95), eps=1e-4, weight_decay=0.01, foreach=False)
    want_losses, want_logprobs = [], []
    for _ in range(3):
        total, lps = 0.0, []
        for x, y, w in data:
            logits = model(input_ids=torch.tensor([x])).logits[0].float()
            lp = logits.log_softmax(-1).gather(1, torch.tensor(y)[:, None])[:, 0]
            loss = -(lp * torch.tensor(w)).sum()
            loss.backward()  # gradients add up over the datums and the chunks until the step
            total += float(loss.detach())
            lps.append(lp.detach())
        torch.nn.utils.clip_grad_norm_(params, 0.5)
        opt.step()
        opt.zero_grad()
        want_losses.append(total)
        want_logprobs.append(lps)

    assert max(norms) > 0.5, f"clipping was not exercised: gradient norms {norms}"
    assert got_losses == pytest.approx(want_losses, abs=TOL)
    for got, want in zip(got_logprobs, want_logprobs):
        assert all(torch.allclose(g, v, atol=TOL) for g, v in zip(got, want))
    ours = served.trainer.model.tenant_tensors(name)
    theirs = peft_lora_tensors(model)
    assert set(ours) == set(theirs)
    diff = max(max((ours[k][0] - theirs[k][0]).abs().max().item(), (ours[k][1] - theirs[k][1]).abs().max().item())
               for k in ours)  # fmt: skip
    assert diff <= TOL, f"the adapter differs from PEFT + AdamW by {diff}"
