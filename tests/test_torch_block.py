"""gateway.torch_block: every sparse MoE block of a transformers model replaced by a remote
block (here served in process by InProcessLayerClient, running the checkpoint's layers)."""
import gc

import numpy as np
import pytest

from tests.torch_extra import require_torch_extra

torch, transformers = require_torch_extra()

from gateway.torch_block import (InProcessLayerClient, RemoteMoEBlock, find_moe_blocks,  # noqa: E402
                                 replace_moe_blocks)
from tests import hf_models as hm  # noqa: E402

torch.set_num_threads(1)
PROMPT = torch.tensor([[1, 5, 7, 9, 11, 3, 40, 41]])


class Recording:
    """Wraps a LayerClient: records what went in and out, to check the zero-copy path."""

    def __init__(self, inner):
        self.inner, self.calls = inner, []

    def send(self, layer, hidden):
        reply, release = self.inner.send(layer, hidden)
        self.calls.append((layer, hidden.ctypes.data, hidden.shape, reply.ctypes.data))
        return reply, release


def greedy(m, n=10):
    with torch.no_grad():
        return m.generate(PROMPT, max_new_tokens=n, do_sample=False, min_new_tokens=n)


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3"])
def test_greedy_tokens_equal_with_every_block_remote(tmp_path, family):
    m = hm.model(family)
    m.save_pretrained(str(tmp_path))
    local = greedy(m)
    layers = sorted(hm.moe_blocks(m))
    client = InProcessLayerClient.from_checkpoint(str(tmp_path))
    replaced = replace_moe_blocks(m, client)
    assert sorted(replaced) == layers and not hm.moe_blocks(m)  # none left local
    assert all(isinstance(m.model.layers[L].mlp, RemoteMoEBlock) for L in layers)
    remote = greedy(m)
    assert torch.equal(remote, local), (remote.tolist(), local.tolist())
    assert client.sent == len(layers) * 10  # one request per MoE layer per forward (prefill + 9 steps)
    gc.collect()
    client.close()
    assert client.outstanding == 0  # every reply released once its tensors were gone


def test_the_generation_check_can_fail(tmp_path):
    """A remote layer that is wrong (another checkpoint's) changes the greedy tokens."""
    m = hm.model("mixtral")
    other = hm.model("mixtral", seed=5)
    other.save_pretrained(str(tmp_path))
    local = greedy(m)
    replace_moe_blocks(m, InProcessLayerClient.from_checkpoint(str(tmp_path)))
    assert not torch.equal(greedy(m), local)


def test_zero_copy_both_ways_and_release(tmp_path):
    m = hm.model("qwen2_moe")
    m.save_pretrained(str(tmp_path))
    inner = InProcessLayerClient.from_checkpoint(str(tmp_path))
    rec = Recording(inner)
    replace_moe_blocks(m, rec)
    blk = m.model.layers[0].mlp
    x = hm.hidden(12)
    with torch.no_grad():
        y = blk(x)
    layer, x_ptr, shape, reply_ptr = rec.calls[-1]
    assert layer == 0 and shape == (12, hm.H)
    assert x_ptr == x.data_ptr()  # the client got the tensor's own memory
    assert y.data_ptr() == reply_ptr and y.shape == x.shape  # and we returned a view of the reply
    assert inner.outstanding == 1
    v = y[0, 3:]  # a view keeps the reply alive...
    del y
    gc.collect()
    inner.free_released()
    assert inner.outstanding == 1
    del v  # ...and the last one gone releases it
    gc.collect()
    inner.free_released()
    assert inner.outstanding == 0


def test_bf16_model_through_remote_blocks(tmp_path):
    m = hm.model("qwen3_moe", dtype=torch.bfloat16)
    m.save_pretrained(str(tmp_path))
    x = hm.hidden(16, dtype=torch.bfloat16)
    blk = m.model.layers[1].mlp
    with torch.no_grad():
        want = blk(x).float()
    replace_moe_blocks(m, InProcessLayerClient.from_checkpoint(str(tmp_path), kernel="torch", dtype="bfloat16"))
    with torch.no_grad():
        got = m.model.layers[1].mlp(x)
    assert got.dtype == torch.bfloat16 and got.shape == x.shape
    assert ((got.float() - want).abs().max() / want.abs().max()).item() <= 2e-2


def test_blocks_found_by_class_wherever_they_sit():
    m = hm.model("mixtral")
    layer = m.model.layers[1]
    layer.feed_forward = layer.mlp  # another attribute name, as another model would use
    del layer.mlp
    found = {(attr, L, fam) for _, attr, _, L, fam in find_moe_blocks(m)}
    assert found == {("mlp", 0, "mixtral"), ("feed_forward", 1, "mixtral")}


def test_unsupported_moe_block_class_is_refused():
    m = hm.model("mixtral")

    class OtherMoE(torch.nn.Module):  # looks like a MoE block, of a class we do not serve
        def __init__(self, blk):
            super().__init__()
            self.gate, self.experts = blk.gate, blk.experts

    m.model.layers[1].mlp = OtherMoE(m.model.layers[1].mlp)
    with pytest.raises(ValueError, match=r"MoE blocks of unsupported classes: model.layers.1.mlp \(OtherMoE\)"):
        replace_moe_blocks(m, InProcessLayerClient({}))
    assert [L for *_, L, _ in find_moe_blocks(m, strict=False)] == [0]


def test_a_model_without_moe_blocks_is_refused():
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=64)
    with pytest.raises(ValueError, match="no sparse MoE block"):
        replace_moe_blocks(transformers.AutoModelForCausalLM.from_config(cfg), InProcessLayerClient({}))


def test_router_logits_and_gradients_are_refused(tmp_path):
    m = hm.model("mixtral")
    m.save_pretrained(str(tmp_path))
    replace_moe_blocks(m, InProcessLayerClient.from_checkpoint(str(tmp_path)))
    with pytest.raises(ValueError, match="output_router_logits=True"):
        with torch.no_grad():
            m(PROMPT, output_router_logits=True)
    m.config.output_router_logits = True
    with pytest.raises(ValueError, match="output_router_logits=True"):
        with torch.no_grad():
            m(PROMPT)
    m.config.output_router_logits = False
    x = hm.hidden(4).requires_grad_()
    with pytest.raises(RuntimeError, match="inference-only"):
        m.model.layers[0].mlp(x)


def test_a_bad_reply_is_refused_and_released():
    released = []

    class Bad:
        def send(self, layer, hidden):
            return np.zeros((hidden.shape[0] + 1, hidden.shape[1]), hidden.dtype), lambda: released.append(1)

    m = hm.model("mixtral")
    replace_moe_blocks(m, Bad())
    with pytest.raises(RuntimeError, match="reply is float32"):
        with torch.no_grad():
            m.model.layers[0].mlp(hm.hidden(3))
    assert released == [1]


def test_an_unreachable_gateway_url_leaves_the_model_local():
    """A URL is connected first (gateway.client.GatewayClient): when nobody listens there the
    call fails and no block was replaced (tests/test_models_e2e.py serves real gateways)."""
    import socket

    import transport
    m = hm.model("mixtral")
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(transport.TransportError):
        replace_moe_blocks(m, f"tcp://127.0.0.1:{port}", timeout=2.0)
    assert sorted(hm.moe_blocks(m)) == [0, 1] and not hasattr(m, "moe_client")
