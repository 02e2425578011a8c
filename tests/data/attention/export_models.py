"""Regenerates the exporter-shaped attention graphs of this folder (not run by the tests).

Needs torch (2.13, CPU) and transformers: a 1-layer BERT and GPT-2 with hidden size 16, 2 heads
and random parameters (no download), exported with the TorchScript exporter (opset 17) and the
dynamo exporter (opset 20), each with transformers' eager attention and with sdpa (whose export
adds the Where(IsNaN) guard after the Softmax). Doc strings and metadata are stripped to keep
the files small.

    python tests/data/attention/export_models.py
"""

from pathlib import Path

import onnx
import torch
from transformers import BertConfig, BertModel, GPT2Config, GPT2Model

HERE = Path(__file__).resolve().parent


class Wrapper(torch.nn.Module):
    def __init__(self, model: torch.nn.Module, gpt2: bool):
        super().__init__()
        self.model, self.gpt2 = model, gpt2

    def forward(self, input_ids, attention_mask):
        kw = {"use_cache": False} if self.gpt2 else {}
        return self.model(
            input_ids=input_ids, attention_mask=attention_mask, **kw
        ).last_hidden_state


def build(kind: str, impl: str) -> torch.nn.Module:
    if kind == "bert":
        cfg = BertConfig(
            vocab_size=32,
            hidden_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=32,
            max_position_embeddings=16,
            attn_implementation=impl,
        )
        model = BertModel(cfg)
    else:
        cfg = GPT2Config(
            vocab_size=32,
            n_embd=16,
            n_layer=1,
            n_head=2,
            n_positions=16,
            bos_token_id=0,
            eos_token_id=0,
            attn_implementation=impl,
        )
        model = GPT2Model(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.5)
    return Wrapper(model.eval(), kind == "gpt2").eval()


def strip(path: Path) -> None:
    m = onnx.load(path)
    m.doc_string = ""
    del m.metadata_props[:]
    for n in m.graph.node:
        n.doc_string = ""
        del n.metadata_props[:]
    for vi in m.graph.value_info:
        vi.doc_string = ""
        del vi.metadata_props[:]
    onnx.save(m, path)


def main() -> None:
    torch.manual_seed(0)
    ids = torch.randint(0, 32, (2, 7))
    mask = torch.ones(2, 7, dtype=torch.int64)
    mask[1, 5:] = 0
    for kind in ("bert", "gpt2"):
        for impl in ("eager", "sdpa"):
            model = build(kind, impl)
            for dynamo in (False, True):
                path = HERE / f"{kind}_{impl}_{'dynamo' if dynamo else 'torchscript'}.onnx"
                names = dict(
                    input_names=["input_ids", "attention_mask"], output_names=["last_hidden_state"]
                )
                if dynamo:
                    b, s = torch.export.Dim("batch"), torch.export.Dim("seq", max=16)
                    torch.onnx.export(
                        model,
                        (ids, mask),
                        path,
                        dynamo=True,
                        **names,
                        dynamic_shapes=({0: b, 1: s}, {0: b, 1: s}),
                    )
                else:
                    axes = {0: "batch", 1: "seq"}
                    torch.onnx.export(
                        model,
                        (ids, mask),
                        path,
                        dynamo=False,
                        opset_version=17,
                        dynamic_axes={"input_ids": axes, "attention_mask": axes},
                        **names,
                    )
                strip(path)
                (path.parent / (path.name + ".data")).unlink(missing_ok=True)


if __name__ == "__main__":
    main()
