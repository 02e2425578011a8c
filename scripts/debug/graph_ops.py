"""The optimized graph of a model as a session on the given providers sees it: op counts, and
around every node of the named op types, its producers and readers (op types), to see why a
fusion did or did not match an exporter's pattern.

    python scripts/debug/graph_ops.py MODEL.onnx [--ops FastGelu,Gelu] [--providers CUDA,CPU]
"""

from __future__ import annotations

import argparse
import collections
import sys

import onnxplug as ox


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--ops", default="FastGelu,Gelu,BiasGelu")
    ap.add_argument("--providers", default="CUDA,CPU")
    ap.add_argument("--limit", type=int, default=2, help="nodes shown per op type")
    args = ap.parse_args()
    providers = [p + "ExecutionProvider" for p in args.providers.split(",")]
    g = ox.InferenceSession(args.model, providers=providers)._graph
    counts = collections.Counter(n.op_type for n in g.nodes)
    print("ops:", dict(sorted(counts.items(), key=lambda kv: -kv[1])))
    producer = g.producers()
    readers = g.consumers()
    for op in args.ops.split(","):
        for n in [n for n in g.nodes if n.op_type == op][: args.limit]:
            ins = []
            for i in n.inputs:
                p = producer.get(i)
                pp = [producer[j].op_type for j in (p.inputs if p else []) if j in producer]
                ins.append(f"{i}<-{p.op_type if p else 'input/init'}{pp}")
            outs = [r.op_type for o in n.outputs for r in readers.get(o, [])]
            print(f"{op} {n.name} attrs={n.attrs} ins={ins} readers={outs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
