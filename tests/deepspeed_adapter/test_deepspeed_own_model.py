"""A user's own model under DeepSpeed's bf16 ZeRO-3 with zero.Init, as plain `pytest` in their project runs it
(pytester, real 2-rank runs): float inputs reach the bf16 model without the user casting them, and the nothing-frozen
control is not called silent for a grad that is zero in theory and a few bf16 roundings off it."""

import pytest

pytest.importorskip("deepspeed")
from own_project import HEAD

MODEL = HEAD + '''

class Captioner(nn.Module):
    """Float image features beside tokens, as a vision-language model takes them."""

    def __init__(self):
        super().__init__()
        self.vision = nn.Linear(6, 8)
        self.embed = nn.Embedding(32, 8)
        self.layers = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(8, 32)

    def forward(self, tokens, features):
        x = self.embed(tokens) + self.vision(features).unsqueeze(1)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def batch(global_batch_size, step):
    generator = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, 32, (global_batch_size, 4), generator=generator)
    return {"tokens": tokens, "features": torch.randn(global_batch_size, 6, generator=generator),
            "targets": tokens.flip(-1)}


def loss(model, b):
    """Written for fp32, as most are: nothing here casts the float features to the engine's bf16."""
    logits = model(b["tokens"], b["features"])
    return nn.functional.cross_entropy(logits.float().flatten(0, 1), b["targets"].flatten())


@freeze_case(batch=batch, loss=loss, patterns={"frozen-vision": {"frozen": ["vision.*"]}},
             frameworks=["deepspeed"], plugins=["zero3-bf16"], init=["zero-init"], checkpoint=["none"],
             clip=["clip"])
def captioner():
    return Captioner()
'''


def test_bf16_zero3_takes_float_inputs_and_its_control_is_not_called_silent(pytester, run_user):
    pytester.makepyfile(test_mine=MODEL)
    result, report = run_user()
    assert result.ret == 0, result.stdout.str()[-3000:]
    rows = {c["freeze"]: c for c in report["cells"]}
    assert set(rows) == {"none", "frozen-vision"}
    for row in rows.values():
        assert row["status"] == "pass" and row["severity"] == "ok", (row["freeze"], row["message"])
        assert row["observed"]["precision"] == "bf16", row["observed"]
        assert row["tolerance"]["used"]["grads"] <= 1.0, row["tolerance"]
