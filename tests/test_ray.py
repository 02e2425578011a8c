"""onnxplug.integrations.ray on a local Ray cluster on the CPU (two CPUs): Ray Data gives what
a plain session loop gives, one session per actor; Ray Serve answers good and bad HTTP
requests on localhost, stays healthy after bad ones and batches concurrent requests. Skipped
where Ray is not installed (``pip install "onnxplug[ray]"``)."""

from __future__ import annotations

import io
import json
import os
import urllib.error
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("ray.data")
serve = pytest.importorskip("ray.serve")
pd = pytest.importorskip("pandas")

from onnxplug import InferenceSession  # noqa: E402
from onnxplug.errors import InvalidArgument  # noqa: E402
from onnxplug.integrations.ray import (  # noqa: E402
    OnnxPredictor,
    actor_gpu_ids,
    onnx_deployment,
    providers_for_actor,
)
from tests.integration_models import tabular_expected, tabular_model  # noqa: E402
from tests.ray_cluster import free_port, local_cluster  # noqa: E402

MODEL = tabular_model().SerializeToString()
CPU, CUDA = "CPUExecutionProvider", "CUDAExecutionProvider"
ROWS = 300


@pytest.fixture(scope="module")
def cluster():
    # the GPU is a resource label only, so that a test can see what an actor given a GPU asks
    # for (nothing runs on it)
    with local_cluster(num_cpus=2, num_gpus=1, object_store_memory=256 * 2**20):
        yield


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(7)
    x = rng.standard_normal((ROWS, 4)).astype(np.float32)
    k = rng.integers(-1000, 1000, ROWS)
    return x, k


def _plain_loop(x, k, batch=32):
    """The reference: one session, run over the rows in batches."""
    sess = InferenceSession(MODEL, providers=[CPU])
    outs = [
        sess.run(None, {"x": x[i : i + batch], "k": k[i : i + batch]})
        for i in range(0, len(x), batch)
    ]
    return {name: np.concatenate([o[j] for o in outs]) for j, name in enumerate(["y", "s", "z"])}


# Ray Data ---------------------------------------------------------------------------------------


def test_ray_data_numpy_equals_a_plain_session_loop_with_one_session_per_actor(cluster, data):
    x, k = data

    class Counted(OnnxPredictor):
        """Also says which process and session answered each batch."""

        def __call__(self, batch):
            out = super().__call__(batch)
            rows = len(out["id"])
            out["pid"] = np.full(rows, os.getpid())
            out["session"] = np.full(rows, id(self.session))
            return out

    ds = ray.data.from_items(
        [{"id": i, "x": x[i], "k": int(k[i])} for i in range(ROWS)], override_num_blocks=6
    )
    rows = ds.map_batches(
        Counted,
        fn_constructor_kwargs={"model": MODEL, "keep_columns": ["id"]},
        batch_size=32,
        batch_format="numpy",
        compute=ray.data.ActorPoolStrategy(size=2),
        num_cpus=0.5,
    ).take_all()
    assert len(rows) == ROWS
    rows.sort(key=lambda r: r["id"])
    want = _plain_loop(x, k)
    for name in ("y", "s", "z"):
        np.testing.assert_array_equal(np.stack([r[name] for r in rows]), want[name])
    sessions = {(r["pid"], r["session"]) for r in rows}
    pids = {r["pid"] for r in rows}
    assert len(sessions) == len(pids) <= 2  # one session per actor, reused for its batches
    assert ROWS // 32 + 1 > len(pids)


def test_ray_data_pandas_batches_with_mapped_columns(cluster, data):
    x, k = data
    frame = pd.DataFrame({f"f{i}": x[:, i] for i in range(4)} | {"count": k, "id": range(ROWS)})
    out = (
        ray.data.from_pandas(frame)
        .map_batches(
            OnnxPredictor,
            fn_constructor_kwargs={
                "model": MODEL,
                "input_columns": {"x": ["f0", "f1", "f2", "f3"], "k": "count"},
                "output_columns": {"s": "score", "z": "tripled"},
                "keep_columns": ["id"],
            },
            batch_size=50,
            batch_format="pandas",
            compute=ray.data.ActorPoolStrategy(size=1),
            num_cpus=0.5,
        )
        .to_pandas()
        .sort_values("id")
    )
    assert list(out.columns) == ["score", "tripled", "id"]
    want = _plain_loop(x, k)
    np.testing.assert_array_equal(out["score"].to_numpy(), want["s"])
    np.testing.assert_array_equal(out["tripled"].to_numpy(), want["z"])


def test_ray_data_errors_name_the_model_input_and_the_column(cluster, data):
    x, k = data
    ds = ray.data.from_numpy(x).add_column("k", lambda b: np.zeros(len(b), np.int64))
    with pytest.raises(Exception) as e:
        ds.map_batches(
            OnnxPredictor,
            fn_constructor_kwargs={"model": MODEL, "input_columns": {"x": "pixels", "k": "k"}},
            batch_size=64,
            compute=ray.data.ActorPoolStrategy(size=1),
            num_cpus=0.5,
        ).take_all()
    assert "model input 'x' reads column 'pixels'" in str(e.value)
    assert "'data'" in str(e.value)  # the columns the batch has


def test_an_actor_given_a_gpu_asks_for_cuda(cluster):
    def chosen():
        return providers_for_actor([(CUDA, {"use_tf32": "0"}), CPU], None, actor_gpu_ids())

    with_gpu = ray.remote(num_gpus=1, num_cpus=0)(chosen).remote()
    without = ray.remote(num_gpus=0, num_cpus=0)(chosen).remote()
    assert ray.get(with_gpu) == [(CUDA, {"use_tf32": "0"}), (CPU, {})]
    assert ray.get(without) == [(CPU, {})]


# Ray Serve --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def served(cluster):
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    app = onnx_deployment(
        MODEL,
        max_batch_size=4,
        batch_wait_timeout_s=0.5,
        name="tabular",
        ray_actor_options={"num_cpus": 0.5},
    )
    serve.run(app, name="tab", route_prefix="/tab")
    return f"http://127.0.0.1:{port}/tab"


def _http(url, body=None, method=None, content_type="application/json"):
    req = urllib.request.Request(url, data=body, method=method)
    if body is not None:
        req.add_header("Content-Type", content_type)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.headers.get("content-type"), r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("content-type"), e.read()


def _post(url, inputs, outputs=None):
    doc = {"inputs": inputs} | ({"outputs": outputs} if outputs else {})
    status, _, body = _http(url, json.dumps(doc).encode())
    return status, json.loads(body)


def test_serve_describes_the_model_and_is_healthy(served):
    status, _, body = _http(served)
    meta = json.loads(body)
    assert status == 200
    assert [i["name"] for i in meta["inputs"]] == ["x", "k"]
    assert meta["providers"] == [CPU] and meta["max_batch_size"] == 4
    status, _, body = _http(served + "/health")
    assert (status, json.loads(body)) == (200, {"status": "ok"})


def test_serve_answers_json_and_npz(served, data):
    x, k = data[0][:3], data[1][:3]
    want = tabular_expected(x, k)
    status, doc = _post(served, {"x": x.tolist(), "k": k.tolist()})
    assert status == 200
    np.testing.assert_array_equal(np.array(doc["outputs"]["y"], np.float32), want["y"])
    assert doc["outputs"]["z"] == want["z"].tolist()
    buf = io.BytesIO()
    np.savez(buf, x=x, k=k)
    status, media_type, body = _http(
        served + "?outputs=s", buf.getvalue(), content_type="application/x-npz"
    )
    assert (status, media_type) == (200, "application/x-npz")
    with np.load(io.BytesIO(body)) as archive:
        assert archive.files == ["s"]
        np.testing.assert_array_equal(archive["s"], want["s"])


def test_serve_bad_requests_get_400_and_leave_the_replica_healthy(served, data):
    x, k = data[0][:2].tolist(), data[1][:2].tolist()
    before = json.loads(_http(served + "/stats")[2])
    bad = [
        ({"x": x, "k": k, "pixels": x}, "unknown input(s) ['pixels']"),
        ({"x": [[1.0, 2.0]] * 2, "k": k}, "model input 'x' (tensor(float), shape [N, 4])"),
        ({"x": x, "k": [0.5, 1.5]}, "model input 'k' (tensor(int64), shape [N])"),
        ({"x": x, "k": [[1, 2], [3]]}, "not a rectangular array"),
        ({"x": x}, "missing input(s) ['k']"),
    ]
    for inputs, message in bad:
        status, doc = _post(served, inputs)
        assert status == 400 and message in doc["error"], doc
    status, _, body = _http(served, b"{oops")
    assert status == 400 and "not JSON" in json.loads(body)["error"]
    assert _http(served, b"{}", method="PUT")[0] == 405
    assert _http(served + "/nowhere")[0] == 404
    # still healthy, the same replica (its counters went on), and answering
    assert _http(served + "/health")[0] == 200
    app = serve.status().applications["tab"]
    assert app.status == "RUNNING"
    assert app.deployments["tabular"].status == "HEALTHY"
    status, doc = _post(served, {"x": x, "k": k})
    assert status == 200 and doc["outputs"]["z"] == [3 * v for v in k]
    after = json.loads(_http(served + "/stats")[2])
    assert after["requests"] == before["requests"] + 1  # bad requests never reach a batch
    assert after["failures_in_a_row"] == 0


def test_serve_batches_concurrent_requests(served, data):
    x, k = data
    before = Counter(
        {int(s): n for s, n in json.loads(_http(served + "/stats")[2])["batch_sizes"].items()}
    )
    # eight requests of 1..8 rows at once; up to 4 per batch, each waiting up to 0.5 s for more
    parts = [(x[10 * i : 10 * i + i + 1], k[10 * i : 10 * i + i + 1]) for i in range(8)]
    with ThreadPoolExecutor(8) as pool:
        answers = list(
            pool.map(lambda p: _post(served, {"x": p[0].tolist(), "k": p[1].tolist()}), parts)
        )
    for (xi, ki), (status, doc) in zip(parts, answers):
        assert status == 200
        want = tabular_expected(xi, ki)
        np.testing.assert_array_equal(np.array(doc["outputs"]["s"], np.float32), want["s"])
        assert doc["outputs"]["z"] == want["z"].tolist()
    stats = json.loads(_http(served + "/stats")[2])
    seen = Counter({int(s): n for s, n in stats["batch_sizes"].items()}) - before
    assert sum(size * n for size, n in seen.items()) == 8
    assert max(seen) == 4 and all(size <= 4 for size in seen), seen


def test_serve_handle_takes_and_returns_arrays(served, data):
    x, k = data[0][:2], data[1][:2]
    handle = serve.get_app_handle("tab")
    out = handle.remote({"x": x, "k": k}).result()
    np.testing.assert_array_equal(out["s"], tabular_expected(x, k)["s"])
    with pytest.raises(InvalidArgument, match="missing input"):
        handle.remote({"x": x}).result()
