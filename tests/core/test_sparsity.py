from types import SimpleNamespace

import pytest

from compresskit.sparsity import SparsityReport, layer_linear_macs

SMOLLM2 = SimpleNamespace(
    hidden_size=576,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    intermediate_size=1536,
    num_hidden_layers=30,
)


def test_layer_macs_of_smollm2():
    m = layer_linear_macs(SMOLLM2)
    assert m == {
        "q": 576 * 576,
        "k": 576 * 192,
        "v": 576 * 192,
        "o": 576 * 576,
        "gate": 576 * 1536,
        "up": 576 * 1536,
        "down": 576 * 1536,
    }
    # 30 layers of projections + tied embedding = the model's 134.5M parameters
    assert 30 * sum(m.values()) + 49152 * 576 + 30 * 2 * 576 + 576 == 134_515_008


def test_dense_report_is_zero_and_fractions_add_up():
    rep = SparsityReport.dense(SMOLLM2)
    assert rep.attention == rep.ffn == rep.macs == 0.0
    macs = layer_linear_macs(SMOLLM2)
    rep.layers[0]["ffn"].skipped = macs["gate"] + macs["up"] + macs["down"]  # layer 0's whole FFN
    assert rep.ffn == pytest.approx(1 / 30)
    att, ffn = sum(macs[p] for p in "qkvo"), sum(macs[p] for p in ("gate", "up", "down"))
    assert rep.macs == pytest.approx(ffn / (30 * (att + ffn)))
    d = rep.to_dict()
    assert d["per_layer"][0]["ffn"] == 1.0 and d["per_layer"][1]["ffn"] == 0.0


def test_merge_weights_by_work():
    a, b = SparsityReport.empty(1, dynamic=True), SparsityReport.empty(1, dynamic=True)
    a.layers[0]["ffn"].skipped, a.layers[0]["ffn"].total, a.tokens = 10, 100, 10
    b.layers[0]["ffn"].skipped, b.layers[0]["ffn"].total, b.tokens = 90, 100, 10
    m = a.merge(b)
    assert m.ffn == pytest.approx(0.5) and m.tokens == 20 and m.dynamic
    with pytest.raises(ValueError):
        a.merge(SparsityReport.empty(2))
