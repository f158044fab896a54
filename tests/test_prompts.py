"""Prompt collection: the quality filters and deduplication on hand-computed cases, each source's reader on a
small synthetic file in its real format, the funnel's arithmetic, and Magpie sampling on a tiny random model
(the template prefix it feeds, the stop at the end of the turn, shard resumption, the steered shards' openers
and the prompt manifest's request)."""

from __future__ import annotations

import gzip
import json
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from bench.load import HELDOUT
from bench.load import read_prompts as read_heldout
from common.config import LlamaConfig
from common.model.llama import LlamaModel
from common.model_path import default_model_path
from common.tokenizer import Tokenizer
from training import prompts
from training.dedup import DedupConfig, Deduplicator, Duplicate, MinHasher, shingle_hashes
from training.filters import FilterConfig, is_greeting, is_repetitive, normalize
from training.generate import Sampling, generate_batch, sample_top_p
from training.magpie import (
    DEFAULT_STEER,
    QA_STEERS,
    STEER_FAMILIES,
    STEERS,
    SUMMARY_STEERS,
    WRITING_STEERS,
    MagpieConfig,
    finished_items,
    magpie_stage,
    read_shards,
    sample_shard,
    shard_path,
    steer_counts,
    steer_prefixes,
)
from training.pipeline import Context, build_parser, magpie_config, prompts_request, stage_prompts
from training.prompts import (
    EVAL_LABEL,
    MANIFEST,
    STEPS,
    TRAIN_FILE,
    Funnel,
    PromptConfig,
    build_prompts,
    select_training,
)
from training.sources import (
    TRAIN_SOURCES,
    read_chatterbot,
    read_chitchat,
    read_gsm8k,
    read_humaneval,
    read_jsonl,
    read_mtbench,
    read_sharegpt,
    read_writingbench,
)

CPU = torch.device("cpu")


# ---- filters ----
def test_normalize():
    assert normalize("  Hello,\n WORLD!! ") == "hello world"
    assert normalize("ｆｕｌｌ-width") == "full width"  # NFKC folds full-width letters


def test_repetition():
    assert is_repetitive("buy now " * 6)  # 12 words, 10 trigrams, 2 distinct: 0.2 < 0.5
    assert not is_repetitive("buy now " * 5)  # 10 words: too short to judge by trigrams
    # 12 words, 10 trigrams: "a b c" x 4 has 3 distinct -> 0.3 < 0.5
    assert is_repetitive("a b c a b c a b c a b c")
    assert not is_repetitive("one two three four five six seven eight nine ten eleven twelve")
    assert is_repetitive("x" + "a" * 31)  # a run of 31
    assert not is_repetitive("x" + "a" * 30)


def test_greeting():
    assert is_greeting("Hello! How are you doing today?")
    assert is_greeting("hi anyone here")
    assert not is_greeting("Hi, what is 2+2?")
    assert not is_greeting("Hello, can you write me a poem about the sea?")
    assert not is_greeting("hi hi hi hi hi hi hi hi hi")  # nine words: more than a greeting's eight


def test_filter_reasons():
    cfg = FilterConfig()
    assert cfg.reason("Hi there") == "length"  # 8 characters < 12
    assert cfg.reason("abcdefghijklmnop") == "length"  # one word < 3
    assert cfg.reason("Напиши эссе о море, пожалуйста") == "english"
    assert cfg.reason("buy now " * 6) == "repetition"
    assert cfg.reason("Hello there, how are you?") == "greeting"
    assert cfg.reason("Explain how a hash table works.") is None
    with pytest.raises(ValueError):
        FilterConfig(min_chars=0)
    with pytest.raises(ValueError):
        FilterConfig(min_chars=20, max_chars=10)


# ---- dedup ----
def test_shingles():
    assert shingle_hashes("abcdef", 5).size == 2  # "abcde", "bcdef"
    assert shingle_hashes("abcab", 2).size == 3  # ab, bc, ca, ab -> 3 distinct
    assert shingle_hashes("abc", 5).size == 1  # shorter than a shingle: the whole text
    assert np.array_equal(shingle_hashes("hello world", 5), shingle_hashes("hello world", 5))


def test_minhash_estimates_jaccard():
    a = "the quick brown fox jumps over the lazy dog near the river bank today"
    b = "the quick brown fox jumps over the lazy cat near the river bank today"
    sa, sb = (set(shingle_hashes(normalize(t), 5).tolist()) for t in (a, b))
    true = len(sa & sb) / len(sa | sb)
    h = MinHasher(DedupConfig(num_perm=256, bands=16))
    est = float(np.mean(h.signature(a) == h.signature(b)))
    assert 0.6 < true < 0.9
    assert abs(est - true) < 0.1


def test_deduplicator():
    d = Deduplicator()
    long = "Please write a detailed essay about the history of the printing press in Europe and its effects."
    assert d.add("Explain how a hash table works.", "eval") is None
    assert d.add("explain how a HASH table works!!", "a") == Duplicate("exact", "eval")
    assert d.add(long, "a") is None
    assert d.add(long.replace("detailed", "detailled"), "b") == Duplicate("near", "a")
    assert d.add("What is the capital of France?", "b") is None
    assert d.add("Write a haiku about autumn leaves.", "b") is None
    with pytest.raises(ValueError):
        DedupConfig(num_perm=64, bands=10)


# ---- funnel and selection ----
def test_funnel_counts_steps_passed():
    f = Funnel()
    f.count("english")  # passed raw and length only
    f.count(None)  # passed everything
    f.count("raw")  # counts nowhere
    assert [f.left[s] for s in STEPS] == [2, 2, 1, 1, 1, 1, 1, 1]


class WordTokenizer:
    """encode_chat: one token per word plus 4 for the template."""

    def encode_chat(self, messages):
        return list(range(4 + len(messages[0][1].split())))


def test_select_training():
    cfg = PromptConfig(max_prompt_tokens=16)
    dedup = Deduplicator()
    dedup.add("Write a poem about the sea.", EVAL_LABEL)
    streams = [
        (
            "a",
            [
                ("1", "  write a POEM about the sea  "),  # eval overlap (exact after normalizing)
                ("2", "Hi there!"),  # length
                ("3", "Explain how a hash table works."),  # kept
                ("4", "explain how a HASH table works"),  # dedup
                ("5", " ".join(f"w{i}" for i in range(13))),  # 17 tokens > 16
            ],
        ),
        ("b", [("6", "Explain how a hash table works!"), ("7", "What is the capital of France?")]),
    ]
    rows, funnels = select_training(streams, WordTokenizer(), cfg, dedup)
    assert [(r["id"], r["source"]) for r in rows] == [("3", "a"), ("7", "b")]
    assert rows[0]["text"] == "Explain how a hash table works." and rows[0]["prompt_ids"] == list(range(10))
    assert funnels["a"] == dict(zip(STEPS, [5, 4, 4, 4, 4, 3, 2, 1], strict=True))
    assert funnels["b"] == dict(zip(STEPS, [2, 2, 2, 2, 2, 2, 2, 1], strict=True))


# ---- readers, on synthetic files in each source's format ----
def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "\n", encoding="utf-8")
    return path


def test_read_gsm8k_and_mtbench(tmp_path):
    gsm = write_jsonl(tmp_path / "test.jsonl", [{"question": " Janet has 3 ducks. ", "answer": "#### 3"}])
    assert list(read_gsm8k(gsm)) == [("gsm8k-0", "Janet has 3 ducks.")]
    mt = write_jsonl(
        tmp_path / "question.jsonl",
        [{"question_id": 81, "category": "writing", "turns": ["Compose a blog post.", "Rewrite it."]}],
    )
    assert list(read_mtbench(mt)) == [("mtbench-81", "Compose a blog post.")]


def test_read_humaneval_and_writingbench(tmp_path):
    with gzip.open(tmp_path / "HumanEval.jsonl.gz", "wt", encoding="utf-8") as f:
        f.write(json.dumps({"task_id": "HumanEval/0", "prompt": "def f():\n"}) + "\n")
    assert list(read_humaneval(tmp_path / "HumanEval.jsonl.gz")) == [
        ("HumanEval/0", "Complete the following Python function.\n\ndef f():\n")
    ]
    wb = write_jsonl(tmp_path / "wb.jsonl", [{"index": 1, "query": "Write an essay."}, {"index": 2, "query": "写作"}])
    assert list(read_writingbench(wb)) == [("writingbench-1", "Write an essay.")]


def test_read_sharegpt(tmp_path):
    p = tmp_path / "sg.json"
    p.write_text(
        '[{"id": "a", "conversations": [{"from": "human", "value": " Hi? "}]},'
        ' {"id": "b", "conversations": [{"from": "gpt", "value": "x"}]}, {"id": "c", "conv',
        encoding="utf-8",
    )
    assert list(read_sharegpt(p)) == [("a", "Hi?")]


def test_read_chatterbot(tmp_path):
    (tmp_path / "trivia.yml").write_text(
        "categories:\n- trivia\nconversations:\n- - Who was the 37th President of the United States?\n"
        "  - Richard Nixon\n- - What year was it?\n  - '1963'\n- - 1963\n  - a number\n",
        encoding="utf-8",
    )
    (tmp_path / "ai.yml").write_text("categories:\n- AI\nconversations:\n- - What is AI?\n  - A field.\n")
    assert list(read_chatterbot(tmp_path)) == [
        ("chatterbot-ai-0", "What is AI?"),  # files in name order
        ("chatterbot-trivia-0", "Who was the 37th President of the United States?"),
        ("chatterbot-trivia-1", "What year was it?"),
        ("chatterbot-trivia-2", "1963"),  # YAML reads it as an int
    ]


def test_read_chitchat(tmp_path):
    def msg(text, sender):
        return {"text": text, "timestamp": "2018-05-02T19:38:15Z", "sender": sender}

    data = {
        "c1": {
            "messages": [
                [msg("Hello", "u1"), msg("How are you doing today?", "u1")],  # a greeting: skipped
                [msg("im good", "u2"), msg("did you see the game last night?", "u2")],
                [msg("Yes!", "u1")],
            ],
            "ratings": {},
            "start": "2018-05-02T19:38:15Z",
        },
        "c2": {"messages": [[msg("hi", "u3")]]},  # only a greeting: nothing
    }
    p = tmp_path / "dataset.json"
    p.write_text(json.dumps(data), encoding="utf-8")
    assert list(read_chitchat(p)) == [("chitchat-c1", "im good did you see the game last night?")]


@pytest.mark.parametrize("name", ["mtbench", "gsm8k", "chatterbot", "chitchat"])
def test_installed_sources(name):
    src = TRAIN_SOURCES[name]
    pytest.importorskip(src.package)
    items = list(src.items())
    assert len(items) > 50
    assert all(isinstance(t, str) and t for _, t in items)
    assert len({i for i, _ in items}) == len(items)  # ids are unique


# ---- Magpie ----
@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer(default_model_path())


@pytest.fixture(scope="module")
def tiny(tokenizer):
    """A random 8-layer model over the real vocabulary, so the real template prefix fits (8 layers: the model
    taps layers 2, L//2 and L-3 for EAGLE-3 features)."""
    cfg = LlamaConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_layers=8,
        num_heads=2,
        num_kv_heads=1,
        head_dim=16,
        max_position=128,
    )
    torch.manual_seed(0)
    m = LlamaModel(cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.5)
    return m.eval().requires_grad_(False)


def test_turn_prefix(tokenizer):
    prefix = tokenizer.encode_turn_prefix("user")
    text = "".join(tokenizer.tokens(prefix))
    assert text.startswith("<|im_start|>system")
    assert text.endswith("<|im_start|>user" + tokenizer.tokens(tokenizer.encode_prompt("\n"))[0])
    for msg in ("Hello there", "\nleading newline", "Write code: def f(x):"):
        assert tokenizer.encode_chat([("user", msg)])[: len(prefix)] == prefix


class RecordingModel(LlamaModel):
    """Records the token ids of each forward's batch."""

    def __init__(self, base: LlamaModel) -> None:
        super().__init__(base.cfg)
        self.load_state_dict(base.state_dict())
        self.fed: list[torch.Tensor] = []

    def forward(self, batch, cache):
        self.fed.append(batch.input_ids.clone())
        return super().forward(batch, cache)


def test_magpie_feeds_the_prefix(tiny, tokenizer):
    model = RecordingModel(tiny).eval()
    prefix = tokenizer.encode_turn_prefix("user")
    cfg = MagpieConfig(count=3, batch_size=3, shard_size=3, max_new_tokens=4)
    rows = sample_shard(model, prefix, tokenizer.decode, cfg, 0, tokenizer.eos_token_id, CPU)
    assert model.fed[0].tolist() == [prefix] * 3  # the prefill: the template up to the user turn, nothing else
    assert [r["id"] for r in rows] == ["magpie-00000-00000", "magpie-00000-00001", "magpie-00000-00002"]


def test_magpie_stops_at_end_of_turn(tiny):
    prefix = [1, 9, 8, 7]
    cfg = MagpieConfig(count=4, batch_size=4, shard_size=4, max_new_tokens=6, temperature=1.0, top_p=0.9)
    full = generate_batch(tiny, [prefix] * 4, 6, 0, CPU, cfg.sampling(0, 0))  # 0: a token never sampled here
    assert all(len(r) == 6 and 0 not in r for r in full)
    eot = full[0][2]  # pretend the third sampled token of row 0 ends the turn
    stopped = generate_batch(tiny, [prefix] * 4, 6, eot, CPU, cfg.sampling(0, 0))
    for f, s in zip(full, stopped, strict=True):
        cut = f.index(eot) + 1 if eot in f else len(f)
        assert s == f[:cut]  # same draws, cut right after the first end-of-turn token
    rows = sample_shard(tiny, prefix, lambda ids: " ".join(map(str, ids)), cfg, 0, eot, CPU)
    assert rows[0] == {"id": "magpie-00000-00000", "text": " ".join(map(str, full[0][:2])), "tokens": 2} | {
        "finished": True
    }  # the end-of-turn token is not part of the message
    for r, f in zip(rows, full, strict=True):
        assert r["finished"] == (eot in f)
    assert finished_items(rows) == [(r["id"], r["text"]) for r in rows if r["finished"]]
    with pytest.raises(ValueError):
        MagpieConfig(count=1, top_p=0.0)


def test_magpie_shards_resume(tiny, tmp_path):
    prefix = [1, 9, 8, 7]
    cfg = MagpieConfig(count=5, batch_size=2, shard_size=2, max_new_tokens=3)

    def decode(ids):
        return " ".join(map(str, ids))

    prefixes = {DEFAULT_STEER.id: prefix}
    assert not magpie_stage(tiny, prefixes, decode, tmp_path / "late", cfg, 2, CPU, deadline=time.time() - 1)
    assert not list((tmp_path / "late").iterdir())  # the budget was spent before the first shard

    out = tmp_path / "m"
    assert magpie_stage(tiny, prefixes, decode, out, cfg, 2, CPU)
    assert [len(read_shards(out, MagpieConfig(count=n, shard_size=2))) for n in (1, 5)] == [2, 5]
    first = read_shards(out, cfg)
    shard_path(out, 1).unlink()  # as if the run had stopped after shards 0 and 2
    shard_path(out, 0).write_text(shard_path(out, 0).read_text().replace('"id"', '"kept": 1, "id"'))
    assert magpie_stage(tiny, prefixes, decode, out, cfg, 2, CPU)
    again = read_shards(out, cfg)
    assert all(r.get("kept") == 1 for r in again[:2])  # finished shards are not redone
    assert [r["text"] for r in again] == [r["text"] for r in first]  # a redone shard draws the same messages


# ---- Magpie steered shards ----
def steered_ids(cfg: MagpieConfig, n: int) -> dict[int, str]:
    """{shard: steer id} of the shards among 0..n-1 that are steered."""
    return {k: cfg.steer(k).id for k in range(n) if cfg.steer(k) != DEFAULT_STEER}


def test_writing_shards_by_hand():
    # share 0.25: floor(k * 0.25) = 0 0 0 0 1 1 1 1 2 for k = 0..8 steps up after shards 3 and 7
    cfg = MagpieConfig(count=8 * 16, shard_size=16, steered_share=0.25)
    assert steered_ids(cfg, 8) == {3: "writing-story", 7: "writing-poem"}
    assert cfg.steers() == [DEFAULT_STEER, WRITING_STEERS[0], WRITING_STEERS[1]]
    # the count does not move them: 100 shards keep shards 3 and 7, then 11, 15, ...
    assert steered_ids(MagpieConfig(count=100 * 16, shard_size=16, steered_share=0.25), 16) == {
        3: "writing-story",
        7: "writing-poem",
        11: "writing-essay",
        15: "writing-email",
    }
    # share 0.3, read as 3/10: floor(0.3 k) = 0 0 0 0 1 1 1 2 2 2 3 for k = 0..10 -> shards 3, 6, 9 (the binary
    # float 0.3 is just below 3/10: floor(10 x it) would be 2 and shard 9 would not be one)
    assert list(steered_ids(MagpieConfig(count=10, shard_size=1, steered_share=0.3), 10)) == [3, 6, 9]
    # share 1: every shard, the 9 steers in turn (shard 9 starts again with the story)
    every = MagpieConfig(count=10, shard_size=1, steered_share=1.0)
    assert steered_ids(every, 10) == {k: WRITING_STEERS[k % 9].id for k in range(10)}
    assert steered_ids(every, 10)[9] == "writing-story"
    # share 0: plain Magpie everywhere, files named as before
    none = MagpieConfig(count=8, shard_size=1)
    assert none.steered_share == 0.0 and steered_ids(none, 8) == {} and none.steers() == [DEFAULT_STEER]
    assert shard_path(Path("m"), 3) == shard_path(Path("m"), 3, DEFAULT_STEER) == Path("m/magpie-00003.jsonl")
    assert shard_path(Path("m"), 7, WRITING_STEERS[1]) == Path("m/magpie-00007-writing-poem.jsonl")


def test_families_take_turns_by_hand():
    """Families (qa, summary) at share 1: steered shard i takes family i % 2 and that family's steer i // 2; at
    share 0.5, shards 1, 3, 5, 7 are the steered ones 0-3, so they get qa 0, summary 0, qa 1, summary 1."""
    both = MagpieConfig(count=6, shard_size=1, steered_share=1.0, steer_families=("qa", "summary"))
    assert [both.steer(k) for k in range(6)] == [
        QA_STEERS[0],
        SUMMARY_STEERS[0],
        QA_STEERS[1],
        SUMMARY_STEERS[1],
        QA_STEERS[2],
        SUMMARY_STEERS[2],
    ]
    half = MagpieConfig(count=8, shard_size=1, steered_share=0.5, steer_families=("qa", "summary"))
    assert steered_ids(half, 8) == {1: "qa-why-do", 3: "summary-article", 5: "qa-how-does", 7: "summary-passage"}
    # a family runs round: steered shard 16 of (qa, summary) is qa's ninth, its 8 steers wrapped to the first
    assert both.steer(16) == QA_STEERS[0] and both.steer(17) == SUMMARY_STEERS[8 % 6]
    assert MagpieConfig(count=1).steer_families == ("writing",)  # the default: writing shards as before


@pytest.mark.parametrize("families", [(), ("qa", "qa"), ("poetry",)])
def test_steer_families_validate(families):
    with pytest.raises(ValueError, match="steer_families"):
        MagpieConfig(count=1, steered_share=0.5, steer_families=families)


def test_steer_ids_are_unique_and_short():
    ids = [st.id for st in STEERS]
    assert len(set(ids)) == len(ids) == 1 + sum(len(f) for f in STEER_FAMILIES.values()) == 46
    assert all(st.opener for st in STEERS[1:]) and DEFAULT_STEER.opener == ""
    assert all(i.replace("-", "").isalpha() and i.islower() for i in ids)  # safe in a file name


@pytest.mark.parametrize("share", [-0.1, 1.5, float("nan")])
def test_steered_share_validates(share):
    with pytest.raises(ValueError, match="steered_share"):
        MagpieConfig(count=1, steered_share=share)


def test_steer_prefix_is_the_turn_prefix_and_the_opener(tokenizer):
    """A steer's prefix is the template up to the user turn and its opener's tokens: the start of the chat whose
    user message begins with the opener (what the training prompt built from the message will be)."""
    turn = tokenizer.encode_turn_prefix("user")
    prefixes = steer_prefixes(turn, tokenizer.encode_prompt, list(STEERS))
    assert prefixes["default"] == turn
    assert prefixes["writing-email"] == turn + tokenizer.encode_prompt("Draft an email")
    for st in STEERS[1:]:
        chat = tokenizer.encode_chat([("user", st.opener + " about the sea, in a calm tone.")])
        assert chat[: len(prefixes[st.id])] == prefixes[st.id], st.id


def test_share_zero_samples_as_before(tiny, tokenizer, tmp_path):
    """steered_share 0: the default prefix, the same seeds and the same file and row bytes as before steered
    shards existed (rebuilt here the way magpie.py wrote them: generate_batch under cfg.sampling(k, b), rows
    {"id", "text", "tokens", "finished"} and nothing else)."""
    cfg = MagpieConfig(count=5, batch_size=2, shard_size=3, max_new_tokens=4)
    prefix = tokenizer.encode_turn_prefix("user")
    eos = tokenizer.eos_token_id
    assert magpie_stage(tiny, {DEFAULT_STEER.id: prefix}, tokenizer.decode, tmp_path, cfg, eos, CPU)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["magpie-00000.jsonl", "magpie-00001.jsonl"]
    for k, n in ((0, 3), (1, 2)):  # 5 messages in shards of 3, batches of 2: [2, 1] and [2]
        rows = []
        for b, s in enumerate(range(0, n, 2)):
            outs = generate_batch(tiny, [prefix] * min(2, n - s), 4, eos, CPU, cfg.sampling(k, b))
            for j, out in enumerate(outs):
                ids = out[:-1] if out[-1:] == [eos] else out
                row = {"id": f"magpie-{k:05d}-{s + j:05d}", "text": tokenizer.decode(ids), "tokens": len(ids)}
                rows.append(row | {"finished": out[-1:] == [eos]})
        want = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
        assert shard_path(tmp_path, k).read_text(encoding="utf-8") == want
    assert {r["steer"] for r in read_shards(tmp_path, cfg)} == {"default"}  # filled in when read


def test_writing_shards_sample_after_their_opener(tiny, tokenizer, tmp_path):
    """Share 0.5 over 4 shards of 2: shards 1 and 3 (floor(k / 2) steps up after them) are prefilled with the
    story and poem prefixes, their messages start with the opener, and they are written under their steer's
    name with "steer" in each row; shards 0 and 2 are those of a share-0 run, which a run with the new share
    takes as they are, never its default shards 1 and 3."""
    steers = [DEFAULT_STEER, WRITING_STEERS[0], DEFAULT_STEER, WRITING_STEERS[1]]
    prefixes = steer_prefixes(tokenizer.encode_turn_prefix("user"), tokenizer.encode_prompt, list(STEERS))
    eos = tokenizer.eos_token_id
    plain = MagpieConfig(count=8, batch_size=2, shard_size=2, max_new_tokens=3)
    assert magpie_stage(tiny, prefixes, tokenizer.decode, tmp_path, plain, eos, CPU)
    before = read_shards(tmp_path, plain)

    model = RecordingModel(tiny).eval()
    cfg = MagpieConfig(count=8, batch_size=2, shard_size=2, max_new_tokens=3, steered_share=0.5)
    assert [cfg.steer(k) for k in range(4)] == steers
    assert magpie_stage(model, prefixes, tokenizer.decode, tmp_path, cfg, eos, CPU)
    prefills = [f.tolist() for f in model.fed if f.shape[1] > 1]  # decode steps feed one token a row
    assert prefills == [[prefixes["writing-story"]] * 2, [prefixes["writing-poem"]] * 2]  # 0 and 2 reused
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "magpie-00000.jsonl",
        "magpie-00001-writing-story.jsonl",
        "magpie-00001.jsonl",
        "magpie-00002.jsonl",
        "magpie-00003-writing-poem.jsonl",
        "magpie-00003.jsonl",
    ]
    stored = [json.loads(line) for line in shard_path(tmp_path, 1, WRITING_STEERS[0]).read_text().splitlines()]
    assert [r["steer"] for r in stored] == ["writing-story"] * 2
    assert all(r["text"].startswith("Write a short story about") and 1 <= r["tokens"] <= 3 for r in stored)
    rows = read_shards(tmp_path, cfg)
    assert [r["steer"] for r in rows] == [st.id for st in steers for _ in range(2)]
    assert all(r["text"].startswith("Write a poem about") for r in rows[6:8])
    assert [r["id"] for r in rows] == [r["id"] for r in before]  # ids unique and as before: magpie-KKKKK-IIIII
    assert rows[0:2] + rows[4:6] == before[0:2] + before[4:6]  # shards 0 and 2: the share-0 run's
    counts = steer_counts(rows)
    assert list(counts) == ["default", "writing-story", "writing-poem"]
    assert [c["generated"] for c in counts.values()] == [4, 2, 2]
    assert sum(c["finished"] for c in counts.values()) == len(finished_items(rows))


def test_prompts_manifest_tracks_the_steers(tiny, tokenizer, tmp_path, monkeypatch):
    """The prompts stage reuses a build only for the same request: a changed --magpie-steered or --magpie-families
    is another request (the stage goes on to sample; --minutes 0 stops it before the first shard), the same one,
    read back from the manifest's JSON, is found built."""
    monkeypatch.setattr(Context, "tokenizer", property(lambda self: tokenizer))
    monkeypatch.setattr(Context, "model", property(lambda self: tiny))

    def args(share: str, magpie: str = "4", families: str = "qa,summary"):
        argv = ["prompts", "--workdir", str(tmp_path), "--magpie", magpie, "--magpie-shard", "2", "--minutes", "0"]
        return build_parser().parse_args([*argv, "--magpie-steered", share, "--magpie-families", families])

    request = prompts_request(args("0.3"), magpie_config(args("0.3")))
    assert request["magpie"]["steered_share"] == 0.3 and request["magpie"]["steer_families"] == ["qa", "summary"]
    defaults = build_parser().parse_args(["prompts", "--workdir", "w"])
    assert (defaults.magpie_steered, defaults.magpie_families) == (0.0, "writing")
    (tmp_path / MANIFEST).write_text(json.dumps({"request": request}))
    assert stage_prompts(Context(args("0.3")))  # already built
    assert not (tmp_path / "magpie").exists()
    assert not stage_prompts(Context(args("0.3", families="qa")))  # another request: rebuilding, out of time
    assert list((tmp_path / "magpie").iterdir()) == []
    assert not stage_prompts(Context(args("0")))

    assert magpie_config(args("0", magpie="0")) is None
    with pytest.raises(ValueError, match="--magpie-steered"):
        magpie_config(args("0.3", magpie="0"))
    with pytest.raises(ValueError, match="steered_share"):
        magpie_config(args("1.5"))
    with pytest.raises(ValueError, match="steer_families"):
        magpie_config(args("0.3", families="qa,poetry"))


class NoItems:
    def items(self) -> list:
        return []


def test_heldout_benchmark_prompts_are_never_trained_on(tokenizer, tmp_path, monkeypatch):
    """The benchmarks' held-out prompts enter the deduplicator as eval prompts: a training prompt equal to one, or
    near-equal (punctuation and case), is dropped as eval_overlap; another question on the same subject stays."""
    for source in ("SHAREGPT", "HUMANEVAL", "WRITINGBENCH"):  # the source packages are not installed in CI
        monkeypatch.setattr(prompts, source, NoItems())
    held = [p.text for f in HELDOUT for p in read_heldout(f)]
    leaves = next(t for t in held if t.startswith("Why do leaves"))
    extra = {
        "magpie": [
            ("m0", leaves),
            ("m1", leaves.upper().replace("?", "!")),
            ("m2", "Why do some trees keep their green needles through the whole winter?"),
            ("m3", held[-1]),
        ]
    }
    manifest = build_prompts(tmp_path, tokenizer, PromptConfig(heldout=0), [], extra)
    assert [r["id"] for r in read_jsonl(tmp_path / TRAIN_FILE)] == ["m2"]
    assert manifest["funnel"]["magpie"]["tokens"] == 4 and manifest["funnel"]["magpie"]["eval_overlap"] == 1
    assert manifest["counts"]["heldout_bench"] == len(held) == 144


def test_sample_top_p_keeps_the_nucleus():
    # probabilities [0.5, 0.3, 0.2]: mass before each token [0, 0.5, 0.8]; top_p 0.7 keeps tokens 0 and 1
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]])).expand(4000, 3)
    drawn = sample_top_p(logits, 1.0, 0.7, torch.Generator().manual_seed(0))
    counts = torch.bincount(drawn, minlength=3).tolist()
    assert counts[2] == 0
    assert abs(counts[0] / 4000 - 0.625) < 0.03  # 0.5 / 0.8 after renormalizing
    with pytest.raises(ValueError):
        Sampling(temperature=0.0)
