"""CPU kernels of the ``ai.onnx.ml`` domain that onnx.reference lacks or that must behave as
onnxruntime's do: what scikit-learn pipelines converted by skl2onnx run on.

* ``ZipMap``: a [N, C] score tensor to a list of N dicts {class label: score}, the classifier
  output onnxruntime returns to Python.
* ``CastMap``: a map int64 -> float/string to a [1, n] tensor (DENSE: the map's values in key
  order; SPARSE: ``max_map`` slots, missing keys 0 / "0").
* ``CategoryMapper``: strings to int64 and back through two parallel category lists.
* ``DictVectorizer``: a map to a [1, vocabulary] row in the map's value type.
* ``SVMClassifier``/``SVMRegressor``: the kernel matrix of a whole batch at once (onnx.reference
  loops over rows and support vectors in Python), with libsvm's pairwise coupling of the
  class probabilities as onnxruntime computes it (onnx.reference's differs).

The other ops of the domain run onnx.reference's implementations (registered in
``reference``), which match onnxruntime's on the scikit-learn conversions the tests cover.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from onnxplug.ep import Kernel, KernelContext, KernelInfo, KernelRegistry

ML = "ai.onnx.ml"


def _labels(info: KernelInfo, ints: str, strings: str) -> list[Any]:
    """A kernel's class labels: the int64 list if given, else the string list."""
    values = info.attr(ints)
    if values:
        return [int(v) for v in values]
    return list(info.attr(strings) or [])


class ZipMap(Kernel):
    def __init__(self, info: KernelInfo):
        super().__init__(info)
        self.labels = _labels(info, "classlabels_int64s", "classlabels_strings")
        if not self.labels:
            raise ValueError(
                f"ZipMap node '{info.name}': classlabels_int64s or classlabels_strings is needed"
            )

    def compute(self, ctx: KernelContext) -> None:
        x = np.asarray(ctx.input(0), dtype=np.float32)
        rows = x.reshape(1, -1) if x.ndim == 1 else x
        if rows.ndim != 2 or rows.shape[1] != len(self.labels):
            raise ValueError(
                f"ZipMap node '{self.info.name}': input of shape {list(x.shape)} has "
                f"{x.shape[-1] if x.ndim else 0} columns for {len(self.labels)} class labels"
            )
        labels = self.labels
        ctx.set_output(0, [dict(zip(labels, map(float, row))) for row in rows.tolist()])


class CastMap(Kernel):
    def __init__(self, info: KernelInfo):
        super().__init__(info)
        self.cast_to = info.attr("cast_to", "TO_FLOAT")
        self.sparse = info.attr("map_form", "DENSE") == "SPARSE"
        self.max_map = int(info.attr("max_map", 1))
        dtypes = {"TO_FLOAT": np.float32, "TO_INT64": np.int64, "TO_STRING": object}
        if self.cast_to not in dtypes:
            raise ValueError(
                f"CastMap node '{info.name}': cast_to '{self.cast_to}' is not one of "
                f"{sorted(dtypes)}"
            )
        if self.sparse and self.max_map < 1:
            raise ValueError(f"CastMap node '{info.name}': max_map must be >= 1 for SPARSE")
        self.dtype = np.dtype(dtypes[self.cast_to])

    def _cast(self, v: Any) -> Any:
        if self.cast_to == "TO_STRING":
            return v if isinstance(v, str) else _float_str(float(v))
        if isinstance(v, str):
            v = float(v)
        return self.dtype.type(v)

    def compute(self, ctx: KernelContext) -> None:
        m = ctx.input(0)
        if not isinstance(m, dict):
            raise ValueError(f"CastMap node '{self.info.name}': the input must be a map")
        if self.sparse:
            fill = "0.f" if self.cast_to == "TO_STRING" else 0  # onnxruntime's filler, verbatim
            out = np.full((1, self.max_map), fill, dtype=self.dtype)
            for k, v in m.items():
                if 0 <= int(k) < self.max_map:
                    out[0, int(k)] = self._cast(v)
        else:
            out = np.array([[self._cast(m[k]) for k in sorted(m)]], dtype=self.dtype)
            out = out.reshape(1, len(m))
        ctx.set_output(0, out)


def _float_str(v: float) -> str:
    """A float as onnxruntime's CastMap writes it (std::to_string: six decimals)."""
    return f"{v:f}"


class CategoryMapper(Kernel):
    def __init__(self, info: KernelInfo):
        super().__init__(info)
        strings = list(info.attr("cats_strings") or [])
        ints = [int(v) for v in info.attr("cats_int64s") or []]
        if len(strings) != len(ints) or not strings:
            raise ValueError(
                f"CategoryMapper node '{info.name}': cats_strings ({len(strings)}) and "
                f"cats_int64s ({len(ints)}) must be non-empty lists of the same length"
            )
        self.to_int = dict(zip(strings, ints))
        self.to_str = dict(zip(ints, strings))
        self.default_int = int(info.attr("default_int64", -1))
        self.default_str = info.attr("default_string", "_Unused")

    def compute(self, ctx: KernelContext) -> None:
        x = ctx.input(0)
        flat = x.reshape(-1)
        if x.dtype == object or x.dtype.kind in "US":
            get, d = self.to_int.get, self.default_int
            out = np.fromiter((get(v, d) for v in flat), dtype=np.int64, count=flat.size)
        else:
            gets, ds = self.to_str.get, self.default_str
            out = np.array([gets(int(v), ds) for v in flat], dtype=object)
        ctx.set_output(0, out.reshape(x.shape))


class DictVectorizer(Kernel):
    """A map to a [1, vocabulary] tensor of its values in vocabulary order (missing keys 0),
    in the map's value type, as onnxruntime returns it."""

    def __init__(self, info: KernelInfo):
        super().__init__(info)
        vocab = _labels(info, "int64_vocabulary", "string_vocabulary")
        if not vocab:
            raise ValueError(
                f"DictVectorizer node '{info.name}': int64_vocabulary or string_vocabulary "
                "is needed"
            )
        self.index = {k: i for i, k in enumerate(vocab)}
        self.size = len(vocab)
        self.dtype = info.output_dtype(0) or np.dtype(np.float32)

    def compute(self, ctx: KernelContext) -> None:
        m = ctx.input(0)
        if not isinstance(m, dict):
            raise ValueError(f"DictVectorizer node '{self.info.name}': the input must be a map")
        out = np.zeros((1, self.size), dtype=self.dtype)
        if self.dtype == object:
            out[:] = ""
        for k, v in m.items():
            i = self.index.get(k)
            if i is not None:
                out[0, i] = v
        ctx.set_output(0, out)


# --- support vector machines ------------------------------------------------------------------


def _svm_kernel(x: np.ndarray, sv: np.ndarray, kind: str, params: list[float]) -> np.ndarray:
    """[rows, vectors]: the kernel of every row with every support vector, in float32 as
    onnxruntime computes it (decisions near 0 keep its sign)."""
    f = np.float32
    gamma, coef0, degree = (f(p) for p in (list(params) + [0.0, 0.0, 0.0])[:3])
    kind = kind.upper()
    if kind == "RBF":
        out = np.empty((x.shape[0], sv.shape[0]), dtype=f)
        step = max(1, (1 << 22) // max(1, sv.size))  # rows per chunk of differences
        for r in range(0, x.shape[0], step):
            d = x[r : r + step, None, :] - sv[None, :, :]
            out[r : r + step] = np.einsum("ijk,ijk->ij", d, d)
        return np.exp(-gamma * out)
    dot = x @ sv.T
    if kind == "LINEAR":
        return dot
    if kind == "POLY":
        return (gamma * dot + coef0) ** int(degree)
    if kind == "SIGMOID":
        return np.tanh(gamma * dot + coef0)
    raise ValueError(f"unknown SVM kernel_type '{kind}'")


class SVMRegressor(Kernel):
    """``rho + sum(coef * K(x, sv))`` for a whole batch at once (``one_class``: its sign)."""

    def __init__(self, info: KernelInfo):
        super().__init__(info)
        self.n_supports = int(info.attr("n_supports", 0))
        self.coef = np.asarray(info.attr("coefficients"), np.float32)
        self.rho = float((info.attr("rho") or [0.0])[0])
        self.kind = info.attr("kernel_type", "LINEAR")
        self.params = list(info.attr("kernel_params") or [])
        self.one_class = bool(info.attr("one_class", 0))
        if info.attr("post_transform", "NONE") != "NONE":
            raise ValueError(
                f"SVMRegressor node '{info.name}': post_transform "
                f"'{info.attr('post_transform')}' is not supported (only NONE)"
            )
        sv = np.asarray(info.attr("support_vectors") or [], np.float32)
        self.sv = sv.reshape(self.n_supports, -1) if self.n_supports else sv

    def compute(self, ctx: KernelContext) -> None:
        x = np.asarray(ctx.input(0), dtype=np.float32)
        x = x.reshape(x.shape[0], -1) if x.ndim > 1 else x.reshape(1, -1)
        if self.n_supports:
            z = _svm_kernel(x, self.sv, self.kind, self.params) @ self.coef[: self.n_supports]
        else:
            z = x @ self.coef  # liblinear: the coefficients are the weights
        z += np.float32(self.rho)
        if self.one_class:
            z = np.where(z > 0, 1.0, -1.0)
        ctx.set_output(0, z.reshape(-1, 1).astype(np.float32))


def _couple(r: np.ndarray) -> np.ndarray:
    """Class probabilities from pairwise ones (libsvm's multiclass_probability, as in
    onnxruntime): ``r[i, j]`` is P(i | i or j)."""
    k = r.shape[0]
    q = np.empty((k, k))
    for t in range(k):
        q[t, t] = (r[:t, t] ** 2).sum() + (r[t + 1 :, t] ** 2).sum()
        q[t, :t] = q[:t, t]
        q[t, t + 1 :] = -r[t + 1 :, t] * r[t, t + 1 :]
    p = np.full(k, 1.0 / k)
    eps = 0.005 / k
    for _ in range(max(100, k)):
        qp = q @ p
        pqp = float(p @ qp)
        if np.abs(qp - pqp).max() < eps:
            break
        for t in range(k):
            diff = (-qp[t] + pqp) / q[t, t]
            p[t] += diff
            pqp = (pqp + diff * (diff * q[t, t] + 2 * qp[t])) / (1 + diff) ** 2
            p /= 1 + diff
            qp = (qp + diff * q[t, :]) / (1 + diff)
    return p


class SVMClassifier(Kernel):
    """One-vs-one SVC (support vectors) or liblinear (weights) classification, with Platt
    probabilities coupled pairwise where ``prob_a``/``prob_b`` are given, and onnxruntime's
    labels and score columns (including its binary special cases)."""

    def __init__(self, info: KernelInfo):
        super().__init__(info)
        from onnx.reference.ops.aionnxml._common_classifier import compute_probit

        self._probit = np.vectorize(compute_probit)
        self.labels = _labels(info, "classlabels_ints", "classlabels_strings")
        self.string_labels = not info.attr("classlabels_ints")
        self.n_classes = max(len(self.labels), 1)
        self.kind = info.attr("kernel_type", "LINEAR")
        self.params = list(info.attr("kernel_params") or [])
        self.post = info.attr("post_transform", "NONE")
        self.rho = np.asarray(info.attr("rho") or [0.0], np.float32)
        coef = np.asarray(info.attr("coefficients") or [], np.float32)
        self.per_class = [int(v) for v in info.attr("vectors_per_class") or []]
        self.n_vectors = sum(self.per_class)
        self.starts = np.cumsum([0, *self.per_class])[:-1].tolist()
        if self.n_vectors:
            sv = np.asarray(info.attr("support_vectors"), np.float32)
            self.sv = sv.reshape(self.n_vectors, -1)
            self.coef = coef.reshape(-1, self.n_vectors)
        else:
            self.coef = coef.reshape(self.n_classes, -1)
        self.prob_a = np.asarray(info.attr("prob_a") or [], np.float64)
        self.prob_b = np.asarray(info.attr("prob_b") or [], np.float64)
        self.all_positive = bool(coef.size) and float(coef.min()) >= 0

    def compute(self, ctx: KernelContext) -> None:
        x = np.asarray(ctx.input(0), dtype=np.float32)
        x = x.reshape(x.shape[0], -1) if x.ndim > 1 else x.reshape(1, -1)
        n, c = x.shape[0], self.n_classes
        votes = None
        if self.n_vectors:
            k = _svm_kernel(x, self.sv, self.kind, self.params)
            pairs: list[np.ndarray] = []
            votes = np.zeros((n, c))
            rows = np.arange(n)
            for i in range(c):
                si, ci = self.starts[i], self.per_class[i]
                for j in range(i + 1, c):
                    sj, cj = self.starts[j], self.per_class[j]
                    s = (
                        self.rho[len(pairs)]
                        + k[:, si : si + ci] @ self.coef[j - 1, si : si + ci]
                        + k[:, sj : sj + cj] @ self.coef[i, sj : sj + cj]
                    )
                    pairs.append(s)
                    np.add.at(votes, (rows, np.where(s > 0, i, j)), 1)
            scores = np.stack(pairs, axis=1) if pairs else np.zeros((n, 0))
        else:
            scores = x @ self.coef.T + self.rho[0]
        has_proba = self.prob_a.size > 0 and self.n_vectors > 0
        if has_proba:
            scores = np.stack([self._probabilities(row) for row in scores])
        pick = votes if votes is not None else scores
        max_class = np.argmax(pick, axis=1)
        max_weight = pick[np.arange(n), max_class]
        second = -1
        if self.rho.size == 1:  # binary: onnxruntime's set_score_svm
            if len(self.labels) == 2:
                second = 2
                if not has_proba and self.all_positive:
                    max_class = np.where(max_weight >= 0.5, 1, max_class)
                idx = max_class
            else:
                idx = (max_weight > 0).astype(np.int64)  # positive class 1, negative 0
        else:
            idx = max_class
        out_scores = self._write_scores(scores, second)
        if self.labels:
            labels = np.asarray(self.labels, dtype=object if self.string_labels else np.int64)
            out = labels[idx]
        else:
            out = idx.astype(np.int64)
        ctx.set_output(0, out)
        ctx.set_output(1, out_scores.astype(np.float32))

    def _probabilities(self, pair_scores: np.ndarray) -> np.ndarray:
        c = self.n_classes
        r = np.zeros((c, c))
        index = 0
        for i in range(c):
            for j in range(i + 1, c):
                v = pair_scores[index] * self.prob_a[index] + self.prob_b[index]
                p = 1.0 - 1.0 / (1.0 + np.exp(-v))  # 1 - logistic(v)
                p = min(max(p, 1.0e-7), 1 - 1.0e-7)
                r[i, j], r[j, i] = p, 1 - p
                index += 1
        return _couple(r)

    def _write_scores(self, s: np.ndarray, second: int) -> np.ndarray:
        post = self.post
        if s.shape[1] >= 2:
            return _transform(s, post, self._probit)
        col = s[:, :1]
        if post == "PROBIT":
            return self._probit(col)
        if second in (2, 3):
            both = np.concatenate([-col, col], axis=1)
            return both if post == "NONE" else _transform(both, post, self._probit)
        return col


def _transform(s: np.ndarray, post: str, probit: Any) -> np.ndarray:
    """onnxruntime's post transforms of a [rows, classes] score matrix."""
    if post == "NONE":
        return s
    if post == "LOGISTIC":
        return 1.0 / (1.0 + np.exp(-s))
    if post == "SOFTMAX":
        e = np.exp(s - s.max(axis=1, keepdims=True))
        return e / e.sum(axis=1, keepdims=True)
    if post == "SOFTMAX_ZERO":
        out = s.copy()
        for row in out:
            m = row.max()
            nz = np.abs(row) > 1e-7
            row[nz] = np.exp(row[nz] - m)
            row[~nz] *= np.exp(-m)
            total = row.sum()
            row[:] = 0.5 if total == 0 else row / total
        return out
    if post == "PROBIT":
        return probit(s)
    raise ValueError(f"unknown post_transform '{post}'")


def register(registry: KernelRegistry) -> None:
    registry.kernel("ZipMap", domain=ML, since=1)(ZipMap)
    registry.kernel("CastMap", domain=ML, since=1)(CastMap)
    registry.kernel("CategoryMapper", domain=ML, since=1)(CategoryMapper)
    registry.kernel("DictVectorizer", domain=ML, since=1)(DictVectorizer)
    registry.kernel("SVMClassifier", domain=ML, since=1)(SVMClassifier)
    registry.kernel("SVMRegressor", domain=ML, since=1)(SVMRegressor)
