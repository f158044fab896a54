"""EAGLE-3 checkpoint layout: save/load round trips (single file and sharded) and foreign key names."""

from __future__ import annotations

import json

import torch
from safetensors.torch import save_file

from common.config import LlamaConfig
from common.model.eagle3 import Eagle3Config, Eagle3Head
from common.model.eagle3_io import load_eagle3, save_eagle3
from common.model.llama import Batch, KVCache

BASE = LlamaConfig(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_layers=6,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    max_position=128,
)


def make_head(draft_vocab: int = 100) -> tuple[Eagle3Head, Eagle3Config]:
    torch.manual_seed(0)
    cfg = Eagle3Config.for_base(BASE, draft_vocab)
    head = Eagle3Head(cfg)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.1)
    head.set_vocab_map(torch.arange(0, 2 * draft_vocab, 2))
    return head.eval(), cfg


def run(head: Eagle3Head) -> torch.Tensor:
    torch.manual_seed(1)
    c = head.cfg
    t = 5
    embeds = torch.randn(1, t, c.hidden_size)
    hidden = torch.randn(1, t, 3 * c.target_hidden_size)
    pos = torch.arange(t)[None]
    batch = Batch.masked(
        input_ids=pos,
        positions=pos,
        slots=torch.tensor([0]),
        write_pos=pos,
        mask=torch.ones(t, t, dtype=torch.bool).tril()[None, None],
    )
    cache = KVCache.allocate(1, 1, t, c.num_kv_heads, c.head_dim, torch.float32, torch.device("cpu"))
    with torch.no_grad():
        return head(embeds, hidden, batch, cache).logp


def check_same(a: Eagle3Head, b: Eagle3Head) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k
    assert torch.equal(run(a), run(b))


def test_round_trip_single_file(tmp_path):
    head, cfg = make_head()
    files = save_eagle3(head, cfg, tmp_path, dtype="float32")
    assert sorted(f.name for f in files) == ["config.json", "model.safetensors"]
    loaded, lcfg = load_eagle3(tmp_path)
    assert lcfg == cfg
    check_same(head, loaded)
    conf = json.loads((tmp_path / "config.json").read_text())
    assert conf["architectures"] == ["LlamaForCausalLMEagle3"]
    assert conf["draft_vocab_size"] == 100 and conf["vocab_size"] == 512 and conf["num_hidden_layers"] == 1


def test_round_trip_sharded(tmp_path):
    head, cfg = make_head()
    limit = 80 * 1024  # forces several shards (the head holds ~330 KB of float32 weights)
    files = save_eagle3(head, cfg, tmp_path, max_shard_bytes=limit, dtype="float32")
    shards = [f for f in files if f.name.startswith("model-")]
    assert len(shards) >= 2
    assert all(f.stat().st_size < limit for f in shards)
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert not (tmp_path / "model.safetensors").exists()
    loaded, _ = load_eagle3(tmp_path)
    check_same(head, loaded)


def test_bf16_save_loads_as_bf16(tmp_path):
    head, cfg = make_head()
    save_eagle3(head, cfg, tmp_path)
    loaded, _ = load_eagle3(tmp_path)
    assert loaded.fc.weight.dtype == torch.bfloat16
    assert torch.equal(loaded.fc.weight, head.fc.weight.to(torch.bfloat16))
    assert torch.equal(loaded.d2t, head.d2t) and torch.equal(loaded.t2d, head.t2d)


def test_public_variants_load(tmp_path):
    """pytorch_model.bin with an extra embed_tokens.weight, and vLLM-style layers.0.* names without t2d."""
    head, cfg = make_head()
    sd = {k: v.clone() for k, v in head.state_dict().items()}
    sd["embed_tokens.weight"] = torch.zeros(BASE.vocab_size, BASE.hidden_size)
    a = tmp_path / "bin"
    a.mkdir()
    save_eagle3(head, cfg, a, dtype="float32")
    (a / "model.safetensors").unlink()
    torch.save(sd, a / "pytorch_model.bin")
    check_same(head, load_eagle3(a)[0])

    b = tmp_path / "vllm"
    b.mkdir()
    save_eagle3(head, cfg, b, dtype="float32")
    renamed = {
        ("layers.0." + k.removeprefix("midlayer.")) if k.startswith("midlayer.") else k: v
        for k, v in sd.items()
        if k != "t2d"
    }
    save_file(renamed, str(b / "model.safetensors"))
    check_same(head, load_eagle3(b)[0])
