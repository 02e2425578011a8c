"""onnxplug.integrations.ray on a GPU: a Ray Data actor given ``num_gpus=1`` and a Serve replica
given ``ray_actor_options={"num_gpus": 1}`` run their sessions on CUDAExecutionProvider (with
the provider options passed) and answer what the CPU answers. Needs Ray besides the GPU."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import numpy as np
import pytest
from tests.gpu._cuda import CPU, CUDA, cuda_marks
from tests.integration_models import tabular_expected, tabular_model
from tests.ray_cluster import free_port, local_cluster

pytestmark = cuda_marks
ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

from onnxplug.integrations.ray import OnnxPredictor, onnx_deployment  # noqa: E402

MODEL = tabular_model().SerializeToString()


@pytest.fixture(scope="module")
def cluster():
    with local_cluster(num_cpus=4, num_gpus=1):
        yield


def test_ray_data_gpu_actor_runs_on_cuda_with_the_given_options(cluster):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((256, 4)).astype(np.float32)
    k = rng.integers(-99, 99, 256)

    class Where(OnnxPredictor):
        def __call__(self, batch):
            out = super().__call__(batch)
            rows = len(out["id"])
            out["provider"] = np.array([self.session.get_providers()[0]] * rows)
            out["tf32"] = np.array(
                [self.session.get_provider_options()[CUDA].get("use_tf32", "")] * rows
            )
            return out

    ds = ray.data.from_items([{"id": i, "x": x[i], "k": int(k[i])} for i in range(256)])
    rows = ds.map_batches(
        Where,
        fn_constructor_kwargs={
            "model": MODEL,
            "keep_columns": ["id"],
            "providers": [(CUDA, {"use_tf32": "0"}), CPU],
        },
        batch_size=64,
        num_gpus=1,
        compute=ray.data.ActorPoolStrategy(size=1),
    ).take_all()
    rows.sort(key=lambda r: r["id"])
    assert {r["provider"] for r in rows} == {CUDA}
    assert {r["tf32"] for r in rows} == {"0"}
    want = tabular_expected(x, k)
    np.testing.assert_allclose(np.stack([r["y"] for r in rows]), want["y"], rtol=1e-6)
    np.testing.assert_allclose([r["s"] for r in rows], want["s"], rtol=1e-5)
    np.testing.assert_array_equal([r["z"] for r in rows], want["z"])


def _http(url, body=None):
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_serve_replica_with_a_gpu_runs_on_cuda(cluster):
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    app = onnx_deployment(MODEL, name="gpu", ray_actor_options={"num_gpus": 1, "num_cpus": 1})
    serve.run(app, name="gpu", route_prefix="/gpu")
    url = f"http://127.0.0.1:{port}/gpu"
    status, meta = _http(url)
    assert status == 200 and meta["providers"][0] == CUDA
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    k = np.array([5, -7])
    status, doc = _http(url, json.dumps({"inputs": {"x": x.tolist(), "k": k.tolist()}}).encode())
    assert status == 200
    np.testing.assert_allclose(doc["outputs"]["s"], tabular_expected(x, k)["s"], rtol=1e-6)
    status, doc = _http(url, json.dumps({"inputs": {"x": x.tolist()}}).encode())
    assert status == 400 and "missing input(s) ['k']" in doc["error"]
    assert _http(url + "/health") == (200, {"status": "ok"})
