"""mlora_lab.rl.pairs against TRL 1.16.0 itself: a ``DPOTrainer`` / ``KTOTrainer`` (tiny llama, PEFT LoRA,
report_to none) is built on a few rows of each preference format, and its processed ``train_dataset`` and
its collator's batch must equal our ids and masks exactly, rows cut and dropped by ``max_length`` included.
Bad rows: every problem of every row in one error."""

from __future__ import annotations

import copy
from unittest import mock

import pytest

from mlora_lab.data import DataError
from mlora_lab.rl import pairs
from mlora_lab.tiny import CHAT_TEMPLATE

# As in test_rl_loss.py: TRL imports trackio when present, which would fix its store folder for this worker.
with (
    mock.patch("transformers.integrations.is_trackio_available", return_value=False),
    mock.patch("transformers.integrations.integration_utils.is_trackio_available", return_value=False),
):
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    peft = pytest.importorskip("peft")
    from trl import DPOConfig, DPOTrainer, KTOConfig, KTOTrainer

import transformers

LONG = "one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen"


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def bot(text: str) -> list[dict]:
    return [{"role": "assistant", "content": text}]


ROWS = {
    "paired": [
        {"prompt": "The sky is", "chosen": " blue.", "rejected": " green."},
        {"prompt": "Two and two make", "chosen": " four</s>", "rejected": " five, or maybe six"},
        {"prompt": LONG, "chosen": " sixteen", "rejected": " zero"},  # cut; dropped under keep_start at 12
        {"prompt": "Say", "chosen": " " + LONG, "rejected": " no"},  # chosen cut by max_length
    ],
    "paired_chat": [
        {"prompt": user("What color is the sky?"), "chosen": bot("Blue."), "rejected": bot("Green.")},
        {
            "prompt": [*user("Hi"), *bot("Hello!"), *user("Count to three")],
            "chosen": bot("one two three"),
            "rejected": bot("three"),
        },
        {"prompt": user(LONG), "chosen": bot("sixteen"), "rejected": bot("zero")},
    ],
    "implicit": [
        {"chosen": "Q: is it day? A: yes it is", "rejected": "Q: is it day? A: no"},
        {"chosen": "The sun is hot", "rejected": "The sun is cold"},
        {
            "chosen": "The cat sat",
            "rejected": "The cat sat down",
        },  # a prefix: TRL's loop keeps its last index
    ],
    "implicit_chat": [
        {
            "chosen": [*user("Where is the sun?"), *bot("In the sky.")],
            "rejected": [*user("Where is the sun?"), *bot("In the sea.")],
        },
        {
            "chosen": [*user("Hi"), *bot("Hello"), *user("Bye"), *bot("Goodbye.")],
            "rejected": [*user("Hi"), *bot("Hello"), *user("Bye"), *bot("No.")],
        },
    ],
}
UNPAIRED = {
    "unpaired": [
        {"prompt": "The sky is", "completion": " blue.", "label": True},
        {"prompt": "The sea is", "completion": " dry", "label": False},
        {"prompt": LONG, "completion": " sixteen", "label": True},
        {"prompt": "Say", "completion": " " + LONG, "label": False},
        {"prompt": "Two and two", "completion": " make four</s>", "label": True},
    ],
    "unpaired_chat": [
        {"prompt": user("What color is the sky?"), "completion": bot("Blue."), "label": True},
        {"prompt": user("What color is grass?"), "completion": bot("Red."), "label": False},
        {"prompt": user(LONG), "completion": bot("sixteen"), "label": False},
    ],
}


@pytest.fixture(scope="module")
def tok(llama_path):
    return transformers.AutoTokenizer.from_pretrained(llama_path)


def build(trainer_cls, config_cls, llama_path, tok, tmp_path, rows, **config):
    model = transformers.AutoModelForCausalLM.from_pretrained(llama_path)
    args = config_cls(
        output_dir=str(tmp_path / "trl"),
        report_to="none",
        use_cpu=True,
        per_device_train_batch_size=2,
        **config,
    )
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    return trainer_cls(
        model=model,
        args=args,
        train_dataset=datasets.Dataset.from_list(rows),
        processing_class=tok,
        peft_config=lora,
    )


def lists(batch: dict) -> dict:
    return {k: v.tolist() for k, v in batch.items()}


# (format, max_length, truncation_mode, rows TRL drops: a prompt alone of >= max_length tokens, keep_start)
CASES = [
    ("paired", None, "keep_start", 0),
    ("paired", 12, "keep_start", 1),
    ("paired", 12, "keep_end", 0),
    ("paired_chat", None, "keep_start", 0),
    ("paired_chat", 45, "keep_start", 1),
    ("implicit", None, "keep_start", 0),
    ("implicit", 14, "keep_start", 0),
    ("implicit_chat", 30, "keep_start", 1),
]


@pytest.mark.filterwarnings("ignore:.*keep_end.*deprecated:FutureWarning")  # TRL 1.16 still applies it
@pytest.mark.parametrize("fmt,max_length,mode,dropped", CASES, ids=[f"{f}-{n}-{m}" for f, n, m, _ in CASES])
def test_pair_ids_and_batch_equal_dpo_trainers(fmt, max_length, mode, dropped, llama_path, tok, tmp_path):
    rows = ROWS[fmt]
    assert pairs.check_rows(rows) == fmt
    trainer = build(
        DPOTrainer, DPOConfig, llama_path, tok, tmp_path, rows, max_length=max_length, truncation_mode=mode
    )
    theirs = [
        {k: ex[k] for k in ("prompt_ids", "chosen_ids", "rejected_ids")} for ex in trainer.train_dataset
    ]
    ours = [pairs.tokenize_pair(r, tok) for r in rows]
    kept = [p for p in ours if pairs.keeps_pair(p, max_length, mode)]
    assert [vars(p) for p in kept] == theirs
    assert len(ours) - len(kept) == dropped
    batch = pairs.collate_pairs(kept, tok.pad_token_id, max_length, mode)
    assert batch == lists(trainer.data_collator(theirs))
    if max_length is not None:  # some sequence was really cut, to exactly max_length
        assert max(len(r) for r in batch["input_ids"]) == max_length
        longest = max(len(p.prompt_ids) + len(p.chosen_ids) for p in kept)
        assert longest > max_length
    # The chosen half's completion tokens are the chosen ids (uncut rows), the prompt before them.
    chosen, _ = pairs.pair_sequences(kept[0], max_length, mode)
    if len(chosen.input_ids) == len(kept[0].prompt_ids) + len(kept[0].chosen_ids):
        assert [t for t, m in zip(chosen.input_ids, chosen.completion_mask) if m] == kept[0].chosen_ids


def test_tools_and_chat_template_kwargs_reach_the_template_as_in_trl(llama_path, tok, tmp_path):
    """A row's ``tools`` (here as JSON text) and ``chat_template_kwargs`` are rendered by the template."""
    tok = copy.deepcopy(tok)
    tok.chat_template = (
        "{% if tools %}[{{ tools | length }} tools]{% endif %}{% if hint %}({{ hint }}){% endif %}"
        + CHAT_TEMPLATE
    )
    rows = [
        {
            **ROWS["paired_chat"][0],
            "tools": '[{"name": "f"}, {"name": "g"}]',
            "chat_template_kwargs": {"hint": "brief"},
        },
        {**ROWS["paired_chat"][1], "tools": "[]", "chat_template_kwargs": {"hint": "long"}},
    ]
    assert pairs.check_rows(rows) == "paired_chat"
    trainer = build(DPOTrainer, DPOConfig, llama_path, tok, tmp_path, rows, max_length=None)
    ours = [vars(pairs.tokenize_pair(r, tok)) for r in rows]
    assert ours == [
        {k: ex[k] for k in ("prompt_ids", "chosen_ids", "rejected_ids")} for ex in trainer.train_dataset
    ]
    assert tok.decode(ours[0]["prompt_ids"]).startswith("[2 tools](brief)")


def test_pad_to_multiple_of_equals_trls_collator(tok):
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    kept = [pairs.tokenize_pair(r, tok) for r in ROWS["paired"]]
    examples = [vars(p) for p in kept]
    theirs = DataCollatorForPreference(pad_token_id=0, max_length=20, pad_to_multiple_of=8)(examples)
    ours = pairs.collate_pairs(kept, 0, 20, pad_to_multiple_of=8)
    assert ours == lists(theirs)
    assert len(ours["input_ids"][0]) % 8 == 0


@pytest.mark.parametrize("fmt,max_length", [("unpaired", None), ("unpaired", 12), ("unpaired_chat", 32)])
def test_unpaired_ids_and_batch_equal_kto_trainers(fmt, max_length, llama_path, tok, tmp_path):
    rows = UNPAIRED[fmt]
    assert pairs.check_rows(rows) == fmt
    trainer = build(KTOTrainer, KTOConfig, llama_path, tok, tmp_path, rows, max_length=max_length)
    keys = ("prompt_ids", "completion_ids", "label")
    theirs = [{k: ex[k] for k in (*keys, "KL_completion_ids")} for ex in trainer.train_dataset]
    ours = [u for u in (pairs.tokenize_unpaired(r, tok) for r in rows) if pairs.keeps_unpaired(u, max_length)]
    assert [vars(u) for u in ours] == [{k: ex[k] for k in keys} for ex in theirs]
    assert (len(ours) < len(rows)) == (max_length is not None)
    kl = pairs.kl_completion_ids([u.completion_ids for u in ours], batch_size=2)
    assert kl == [ex["KL_completion_ids"] for ex in theirs]
    batch = pairs.collate_unpaired(ours, tok.pad_token_id, max_length, kl_ids=kl)
    assert batch == lists(trainer.data_collator(theirs))


def test_paired_rows_unpaired_as_kto_does(llama_path, tok, tmp_path):
    rows = ROWS["implicit"]
    trainer = build(KTOTrainer, KTOConfig, llama_path, tok, tmp_path, rows, max_length=None)
    unpaired = pairs.unpair_rows(rows)
    assert [r["label"] for r in unpaired] == [True] * len(rows) + [False] * len(rows)
    ours = [vars(pairs.tokenize_unpaired(r, tok)) for r in unpaired]
    assert ours == [
        {k: ex[k] for k in ("prompt_ids", "completion_ids", "label")} for ex in trainer.train_dataset
    ]


def test_every_problem_of_every_row_is_named_at_once():
    bad = [
        {"prompt": "p", "chosen": "a"},  # 0: missing rejected
        {"prompt": "p", "chosen": "a", "rejected": "b", "score": 3},  # 1: extra key
        {"prompt": "p", "chosen": 5, "rejected": "b"},  # 2: wrong type
        {"prompt": "p", "chosen": "", "rejected": "b"},  # 3: empty chosen
        {"prompt": "p", "completion": "a", "label": 1},  # 4: label not bool
        {"prompt": "p", "chosen": bot("a"), "rejected": bot("b")},  # 5: text mixed with conversations
        {"prompt": "p", "chosen": "same", "rejected": "same"},  # 6: teaches nothing
        {"chosen": "abc", "rejected": "xyz"},  # 7: no shared prompt
        {
            "prompt": user("p"),
            "chosen": [{"role": "assistant"}],
            "rejected": bot("b"),
        },  # 8: message without content
        "not a row",  # 9
    ]
    with pytest.raises(DataError) as err:
        pairs.check_rows(bad, where="prefs.jsonl")
    problems = err.value.problems
    expected = [
        "missing key 'rejected'",
        "unexpected key 'score'",
        "'chosen' must be a text or a list of {'role', 'content'} messages, not int",
        "'chosen' is empty",
        "'label' must be true or false, not 1",
        "texts mixed with conversations",
        "'chosen' and 'rejected' are the same",
        "share no leading prompt",
        "'chosen'[0] needs 'role' and 'content' strings",
        "a preference row must be an object, not str",
    ]
    for i, words in enumerate(expected):
        assert [p for p in problems if p.startswith(f"prefs.jsonl row {i}: ") and words in p], (i, problems)
    # Each bad row has its one problem; the other lines say which rows differ in format from row 1 (paired).
    per_row = [
        sum(p.startswith(f"prefs.jsonl row {i}: ") and "one format" not in p for p in problems)
        for i in range(10)
    ]
    assert per_row == [1] * 10


def test_formats_are_told_apart_and_mixing_them_is_refused():
    assert pairs.row_format({"chosen": "Q a", "rejected": "Q b", "tools": "[]"}) == ("implicit", [])
    assert pairs.row_format(UNPAIRED["unpaired_chat"][0]) == ("unpaired_chat", [])
    fmt, problems = pairs.row_format(
        {"prompt": "p", "completion": "c", "chosen": "a", "rejected": "b", "label": True}
    )
    assert fmt is None and problems == [
        "mixes paired ('chosen', 'rejected') and unpaired ('completion', 'label') keys"
    ]
    with pytest.raises(DataError, match="row 1: is paired_chat but row 0 is paired: one format per tenant"):
        pairs.check_rows([ROWS["paired"][0], ROWS["paired_chat"][0]])
    with pytest.raises(ValueError, match="truncation_mode must be one of keep_start, keep_end, not 'middle'"):
        pairs.sequence([1], [2], 4, "middle")


def test_the_matched_trl_version_is_installed():
    assert trl.__version__ == "1.16.0", (
        "mlora_lab.rl.pairs follows TRL 1.16.0's lines; re-check it against the new one"
    )
