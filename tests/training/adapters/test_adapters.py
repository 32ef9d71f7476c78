"""ProbVLM and AsymVLM: their densities against scipy, and their training on toys with a known answer."""

from __future__ import annotations

import math

import mpmath
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from scipy import integrate, special, stats

from training.adapters.asymvlm import (
    AsymVLM,
    loglik_matrix,
    ps_log_normaliser,
    symmetric_infonce,
    text_distributions,
    vmf_error_bound,
    vmf_f_d,
    vmf_log_normaliser,
)
from training.adapters.compare import (
    Method,
    asymvlm_method,
    compare_uncertainty,
    markdown_table,
    none_of_the_above,
    retrieval_correct,
)
from training.adapters.fit import fit_asymvlm, fit_probvlm, load_embeddings
from training.adapters.probvlm import gg_nll, gg_variance, head_uncertainty

T64 = torch.float64


@pytest.fixture
def one_thread():
    # Tiny MLPs: thread hand-offs cost more than the matmuls, and the machine's cores are shared.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _unit(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


# --- generalized Gaussian ------------------------------------------------------------------------------


def test_gg_nll_and_variance_match_scipy_gennorm() -> None:
    rng = np.random.default_rng(0)
    x, mu = rng.normal(size=50), rng.normal(size=50)
    alpha, beta = rng.uniform(0.05, 2.0, 50), rng.uniform(0.3, 8.0, 50)
    ours = gg_nll(*(torch.tensor(v, dtype=T64) for v in (x, mu, alpha, beta))).numpy()
    np.testing.assert_allclose(
        ours, -stats.gennorm.logpdf(x, beta, loc=mu, scale=alpha), rtol=1e-12, atol=1e-12
    )
    var = gg_variance(torch.tensor(alpha, dtype=T64), torch.tensor(beta, dtype=T64)).numpy()
    np.testing.assert_allclose(var, stats.gennorm.var(beta, scale=alpha), rtol=1e-10)


# --- vMF normaliser ------------------------------------------------------------------------------------


def _exact_log_c_vmf(d: int, kappa: float) -> float:
    """log C_d(κ) = (d/2−1) log κ − (d/2) log 2π − log I_{d/2−1}(κ), log I from scipy's ive (log ive + κ);
    where ive underflows (large order, small κ) from mpmath's arbitrary-precision Bessel function."""
    nu = d / 2 - 1
    ive = special.ive(nu, kappa)
    if ive > 1e-280:
        log_i = math.log(ive) + kappa
    else:
        log_i = float(mpmath.log(mpmath.besseli(nu, kappa)))
    return (d / 2 - 1) * math.log(kappa) - (d / 2) * math.log(2 * math.pi) - log_i


def test_scipy_and_mpmath_bessel_agree() -> None:
    for nu, k in ((7.0, 1.0), (31.0, 10.0), (127.0, 100.0), (255.0, 1000.0)):
        via_ive = math.log(special.ive(nu, k)) + k
        assert via_ive == pytest.approx(float(mpmath.log(mpmath.besseli(nu, k))), rel=1e-10)


def test_vmf_f_d_against_exact_log_normaliser() -> None:
    """F_d approximates log C_d only up to a constant in d (App. A.1 integrates the derivative): anchored at
    the exact κ = 0 value, the error must stay under the closed-form bound from the Bessel-ratio bounds."""
    kappas = [1.0, 10.0, 100.0, 1000.0]
    report = []
    for d in (16, 64, 256, 512):
        k = torch.tensor(kappas, dtype=T64)
        exact = np.array([_exact_log_c_vmf(d, kk) for kk in kappas])
        approx = vmf_log_normaliser(k, d).numpy()
        bound = vmf_error_bound(k, d).numpy()
        err = np.abs(approx - exact)
        assert np.all(err <= bound + 1e-9), (d, err, bound)
        # the constant-free comparison: (log C_d − F_d) is nearly the same at every κ
        offset = exact - vmf_f_d(k, d).numpy()
        report.append((d, err.max(), (err / np.abs(exact)).max(), bound.max(), np.ptp(offset)))
    for d, abs_err, rel_err, bnd, spread in report:
        print(f"d={d:4d} max|err|={abs_err:.3e} max rel={rel_err:.2e} bound={bnd:.3e} spread={spread:.3e}")
    # measured: at most 0.096 nats (d=64, κ=1000), relative 1.2% (d=16, κ=10, where log C_d ≈ −4)
    assert max(r[1] for r in report) < 0.1


def test_vmf_error_bound_is_the_integral_of_the_bound_gap() -> None:
    d, kappa = 64, 37.0
    a, b = (d - 1) / 2, (d + 1) / 2
    gap = integrate.quad(
        lambda t: 0.5 * (t / (a + math.sqrt(a * a + t * t)) - t / (a + math.sqrt(b * b + t * t))), 0, kappa
    )[0]
    assert float(vmf_error_bound(torch.tensor(kappa, dtype=T64), d)) == pytest.approx(gap, rel=1e-10)


# --- Power Spherical normaliser ------------------------------------------------------------------------


@pytest.mark.parametrize("d", [3, 4, 8])
def test_ps_normaliser_against_quadrature(d: int) -> None:
    """∫_{S^{d−1}} (1+μᵀx)^κ dx = |S^{d−2}| ∫_{−1}^{1} (1+t)^κ (1−t²)^{(d−3)/2} dt must equal 1/C_d(κ)."""
    area = 2 * math.pi ** ((d - 1) / 2) / math.gamma((d - 1) / 2)  # surface of S^{d−2}
    for kappa in (0.0, 0.5, 3.0, 20.0):
        integral = integrate.quad(lambda t, k=kappa: (1 + t) ** k * (1 - t * t) ** ((d - 3) / 2), -1, 1)[0]
        expected = -math.log(area * integral)
        got = float(ps_log_normaliser(torch.tensor(kappa, dtype=T64), d))
        assert got == pytest.approx(expected, abs=1e-8), (d, kappa)


def test_loglik_matrix_and_infonce() -> None:
    rng = np.random.default_rng(2)
    mu = torch.tensor(_unit(rng.normal(size=(3, 5))))
    z = torch.tensor(_unit(rng.normal(size=(4, 5))))
    kappa = torch.tensor([0.5, 2.0, 9.0], dtype=T64)
    L = loglik_matrix(mu, kappa, z, "vmf")
    cos = (mu @ z.T).numpy()
    exact = np.array(
        [[k * c + _exact_log_c_vmf(5, k) for c in row] for k, row in zip(kappa.tolist(), cos, strict=True)]
    )
    assert np.abs(L.numpy() - exact).max() <= float(vmf_error_bound(kappa, 5).max()) + 1e-12
    Lps = loglik_matrix(mu, kappa, z, "ps").numpy()
    np.testing.assert_allclose(
        Lps, kappa.numpy()[:, None] * np.log1p(cos) + ps_log_normaliser(kappa, 5).numpy()[:, None]
    )
    # Eq. 2 written out: −1/(2B) Σ_n [log softmax over row n + log softmax over column n]
    sq = torch.tensor(rng.normal(size=(4, 4)))
    ref = -0.5 * (torch.log_softmax(sq, 1).diag().mean() + torch.log_softmax(sq, 0).diag().mean())
    assert float(symmetric_infonce(sq)) == pytest.approx(float(ref))


# --- training on toys ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_probvlm_learns_larger_variance_on_noisier_dimensions(one_thread) -> None:
    """Text = image + per-dimension noise (σ = 0.01 on dims 0–3, 0.3 on dims 4–7). With λ_cross = 1 the
    image head must predict the text: its variance α²Γ(3/β)/Γ(1/β) (not α alone: β trades against α)
    should be far larger on the noisy dimensions. lr 1e−2 instead of 1e−4 keeps the test short."""
    rng = np.random.default_rng(0)
    img = 0.3 * rng.normal(size=(256, 8))
    txt = img + np.array([0.01] * 4 + [0.3] * 4) * rng.normal(size=(256, 8))
    model, hist = fit_probvlm(img, txt, epochs=150, lr=1e-2, batch_size=256, lambda_cross=1.0, hidden=32)
    assert hist[-1]["loss"] < hist[0]["loss"] - 3.0
    with torch.no_grad():
        _, a, b = model.image(torch.tensor(img, dtype=torch.float32))
    var = gg_variance(a, b).mean(0).numpy()
    assert var[4:].mean() > 5 * var[:4].mean(), var
    u = head_uncertainty(model.image, torch.tensor(img[:16], dtype=torch.float32), n_passes=5)
    assert torch.all(u.epistemic > 0) and torch.all(u.total > u.aleatoric)
    assert torch.all(
        head_uncertainty(model.image, torch.tensor(img[:4], dtype=torch.float32), 1).epistemic == 0
    )


def _ambiguity_toy() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """4 ambiguous captions, each shared by 16 images spread around it (16 > d = 8, so no direction fits
    them all equally), and 64 unique captions each paired with an image almost on top of it."""
    rng = np.random.default_rng(0)
    centres = _unit(rng.normal(size=(4, 8)))
    amb_txt = np.repeat(centres, 16, axis=0)
    amb_img = _unit(amb_txt + 0.3 * rng.normal(size=amb_txt.shape))
    u_txt = _unit(rng.normal(size=(64, 8)))
    u_img = _unit(u_txt + 0.02 * rng.normal(size=u_txt.shape))
    ambiguous = np.arange(128) < 64
    return np.concatenate([amb_img, u_img]), np.concatenate([amb_txt, u_txt]), ambiguous


@pytest.mark.parametrize("head", ["vmf", "ps"])
def test_asymvlm_gives_ambiguous_captions_lower_kappa(head: str, one_thread) -> None:
    img, txt, ambiguous = _ambiguity_toy()
    model, hist = fit_asymvlm(img, txt, head=head, epochs=200, lr=0.1, batch_size=128, hidden=32)
    assert hist[-1]["loss"] < hist[0]["loss"] - 2.0
    _, kappa = text_distributions(model, torch.tensor(txt, dtype=torch.float32))
    k = kappa.numpy()
    assert k[~ambiguous].mean() > 1.5 * k[ambiguous].mean(), (k[ambiguous].mean(), k[~ambiguous].mean())
    # the calibration the metric expects: uncertain (1/κ large) captions are the ones retrieved wrongly
    uids = [str(i) for i in range(128)]
    m = asymvlm_method(model, img, txt, uids)
    assert m.correct_t2i[~ambiguous].mean() > m.correct_t2i[ambiguous].mean()


def test_fits_are_deterministic(one_thread) -> None:
    img, txt, _ = _ambiguity_toy()
    img, txt = img[:64], txt[:64]
    a, ha = fit_asymvlm(img, txt, epochs=3, batch_size=32, hidden=16, seed=5)
    b, hb = fit_asymvlm(img, txt, epochs=3, batch_size=32, hidden=16, seed=5)
    assert ha == hb and all(torch.equal(a.state_dict()[k], b.state_dict()[k]) for k in a.state_dict())
    p, hp = fit_probvlm(img, txt, epochs=2, batch_size=32, hidden=16, seed=5)
    q, hq = fit_probvlm(img, txt, epochs=2, batch_size=32, hidden=16, seed=5)
    assert hp == hq and all(torch.equal(p.state_dict()[k], q.state_dict()[k]) for k in p.state_dict())
    with pytest.raises(ValueError, match="NaN"):
        fit_probvlm(np.full((4, 8), np.nan), txt[:4], epochs=1)


# --- comparison ----------------------------------------------------------------------------------------


def test_retrieval_correct_counts_identical_captions_for_i2t_only() -> None:
    scores = np.array([[0.9, 0.85, 0.0], [0.8, 0.2, 0.0], [0.0, 0.1, 0.7]])
    ci, ct, top = retrieval_correct(scores, ["a", "b", "c"], ["red circle", "red circle", "blue"])
    assert top.tolist() == [0, 0, 2]
    assert ci.tolist() == [True, True, True]  # image b retrieved caption a, the same string
    assert ct.tolist() == [True, False, True]  # caption b retrieves image a: wrong


def test_compare_table_and_none_of_the_above() -> None:
    n = 100
    u = np.arange(n, dtype=float)
    correct = np.concatenate([np.arange(10) < 10 - k for k in range(10)])
    rows = compare_uncertainty(
        {"ideal": (u, u), "reversed": Method(u[::-1].copy(), u[::-1].copy())}, correct, correct
    )
    assert rows[0]["i2t"]["score"] == pytest.approx(1.0) and rows[1]["t2i"]["S"] == pytest.approx(1.0)
    table = markdown_table(rows)
    assert "| ideal | 0.550 | -1.000 | 1.000 | 1.000 |" in table and table.count("\n") == 4
    # classes 0, 1 seen; class 2 unseen; dummy in column 2
    scores = np.array([[0.9, 0.1, 0.5], [0.2, 0.8, 0.5], [0.9, 0.1, 0.95], [0.1, 0.2, 0.6], [0.7, 0.1, 0.2]])
    res = none_of_the_above(scores, np.array([0, 1, 0, 2, 2]), [0, 1], dummy_column=2)
    assert res == {"pos_acc": 2 / 3, "neg_acc": 0.5, "pos_dummy_rate": 1 / 3, "n_pos": 3, "n_neg": 2}


@pytest.mark.parametrize("fixed", [True, False])
def test_load_embeddings_reads_list_columns_and_drops_failed_rows(tmp_path, fixed: bool) -> None:
    vec = np.arange(12, dtype=np.float32).reshape(3, 4)
    typ = pa.list_(pa.float32(), 4) if fixed else pa.list_(pa.float32())
    table = pa.table(
        {
            "uid": ["u0", "u1", "u2"],
            "ok": [True, False, True],
            "text": ["a", "b", "c"],
            "image_mu": pa.array(list(vec), type=typ),
            "text_mu": pa.array(list(-vec), type=typ),
        }
    )
    pq.write_table(table, tmp_path / "e.parquet")
    out = load_embeddings(str(tmp_path / "e.parquet"))
    assert out["uid"].tolist() == ["u0", "u2"] and out["text"].tolist() == ["a", "c"]
    np.testing.assert_array_equal(out["image_mu"], vec[[0, 2]])
    np.testing.assert_array_equal(out["text_mu"], -vec[[0, 2]])
    assert "image_logvar" not in out
    model = AsymVLM(4, "ps", hidden=8)
    assert loglik_matrix(*model(torch.tensor(out["text_mu"])), torch.tensor(out["image_mu"]), "ps").shape == (
        2,
        2,
    )


def test_job_writes_table_json_and_loadable_weights(tmp_path, one_thread) -> None:
    from jobs.adapters import main

    rng = np.random.default_rng(0)
    n, d = 40, 8
    img = _unit(rng.normal(size=(n, d))).astype(np.float32)
    txt = _unit(img + 0.2 * rng.normal(size=(n, d))).astype(np.float32)
    vec = pa.list_(pa.float32(), d)
    table = pa.table(
        {
            "uid": [f"u{i}" for i in range(n)],
            "ok": [True] * n,
            "text": [f"t{i}" for i in range(n)],
            "image_mu": pa.array(list(img), type=vec),
            "text_mu": pa.array(list(txt), type=vec),
            "image_logvar": pa.array(list(rng.normal(-5, 1, (n, d)).astype(np.float32)), type=vec),
            "text_logvar": pa.array(list(rng.normal(-4, 1, (n, d)).astype(np.float32)), type=vec),
        }
    )
    pq.write_table(table, tmp_path / "emb.parquet")
    emb, out = str(tmp_path / "emb.parquet"), str(tmp_path / "out")
    args = ["--train", emb, "--eval", emb, "--out", out, "--probvlm-epochs", "1", "--asymvlm-epochs", "1"]
    assert main([*args, "--mc-passes", "2"]) == 0
    md = (tmp_path / "out" / "adapters.md").read_text()
    for name in ("own Σσ²", "ProbVLM (aleatoric)", "ProbVLM (total)", "AsymVLM (vmf)", "AsymVLM (ps)"):
        assert f"| {name} |" in md
    state = torch.load(tmp_path / "out" / "asymvlm_ps.pt", weights_only=True)
    AsymVLM(d, "ps").load_state_dict(state)
    assert main([*args, "--native", "broken"]) == 2
