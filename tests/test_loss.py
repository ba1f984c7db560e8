"""The chunked head cross-entropy equals F.cross_entropy over the whole logits, value and gradients."""

import pytest
import torch
import torch.nn.functional as F

import archlab.loss
from archlab.loss import IGNORE, linear_cross_entropy, scores
from conftest import tiny_model


def reference(hidden, weight, targets):
    return F.cross_entropy(hidden @ weight.T, targets, ignore_index=IGNORE)


@pytest.mark.parametrize("chunk_rows", [1, 7, 64])
def test_equals_cross_entropy_over_whole_logits(chunk_rows, monkeypatch):
    monkeypatch.setattr(archlab.loss, "CHUNK_ELEMENTS", chunk_rows * 50)
    hidden = torch.randn(40, 16, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(50, 16, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 50, (40,))
    targets[::3] = IGNORE
    grads = []
    for loss_of in (linear_cross_entropy, reference):
        loss = loss_of(hidden, weight, targets)
        (2.5 * loss).backward()  # a scaled loss scales both gradients
        grads.append((loss.detach(), hidden.grad.clone(), weight.grad.clone()))
        hidden.grad = weight.grad = None
    for got, expected in zip(*grads):
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("chunk_rows", [1, 7, 64])
def test_evaluation_scores_equal_those_of_the_whole_logits(chunk_rows, monkeypatch):
    monkeypatch.setattr(archlab.loss, "CHUNK_ELEMENTS", chunk_rows * 50)
    hidden, weight = torch.randn(40, 16, dtype=torch.float64), torch.randn(50, 16, dtype=torch.float64)
    logits = hidden @ weight.T
    targets = logits.argmax(-1)
    targets[1::2] = torch.randint(0, 50, (20,))  # some wrong, most likely
    targets[::3] = IGNORE
    counted = targets != IGNORE
    expected = torch.stack((F.cross_entropy(logits, targets, ignore_index=IGNORE, reduction="sum"),
                            (logits.argmax(-1) == targets)[counted].sum().double(), counted.sum().double()))
    assert 0 < expected[1] < expected[2]  # right and wrong answers, to count apart
    torch.testing.assert_close(scores(hidden, weight, targets), expected, rtol=1e-12, atol=1e-12)


def test_a_batch_with_no_counted_target_gives_a_loss_and_gradients_of_zero():
    """Every target ignored (a fine-tuning batch of prompts alone): the mean over no positions is
    taken as 0 with zero gradients, where F.cross_entropy's 0 / 0 would put nan into the optimizer."""
    hidden = torch.randn(6, 8, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(20, 8, dtype=torch.float64, requires_grad=True)
    loss = linear_cross_entropy(hidden, weight, torch.full((6,), IGNORE))
    loss.backward()
    assert loss.item() == 0.0
    assert not hidden.grad.any() and not weight.grad.any()


def test_a_last_chunk_of_one_row_is_counted(monkeypatch):
    """41 rows in chunks of 8 leave row 40 alone in the last chunk: its loss, its gradient and its
    scores are counted as over the whole logits (the other tests' last rows are ignored ones)."""
    monkeypatch.setattr(archlab.loss, "CHUNK_ELEMENTS", 8 * 50)
    hidden = torch.randn(41, 16, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(50, 16, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 50, (41,))
    targets[:40] = IGNORE  # the loss is the last row's alone
    loss = linear_cross_entropy(hidden, weight, targets)
    loss.backward()
    logits = hidden.detach()[40] @ weight.detach().T
    expected = logits.logsumexp(-1) - logits[targets[40]]
    torch.testing.assert_close(loss.detach(), expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(hidden.grad[40], (logits.softmax(-1) - F.one_hot(targets[40], 50)) @ weight.detach(),
                               rtol=1e-12, atol=1e-12)
    assert not hidden.grad[:40].any()
    got = scores(hidden.detach(), weight.detach(), targets)
    assert got.tolist() == pytest.approx([expected.item(), float(logits.argmax() == targets[40]), 1.0], rel=1e-12)


def test_under_bfloat16_autocast_is_close_to_float32():
    hidden = torch.randn(64, 32, requires_grad=True)
    weight = torch.randn(300, 32, requires_grad=True)
    targets = torch.randint(0, 300, (64,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = linear_cross_entropy(hidden, weight, targets)
    loss.backward()
    assert loss.dtype == torch.float32 and weight.grad.dtype == torch.float32
    got = (loss.detach(), hidden.grad.clone(), weight.grad.clone())
    hidden.grad = weight.grad = None
    expected = reference(hidden, weight, targets)
    expected.backward()
    torch.testing.assert_close(got[0], expected.detach(), rtol=2e-2, atol=2e-2)
    for g, e in zip(got[1:], (hidden.grad, weight.grad)):
        assert (g - e).norm() / e.norm() < 2e-2


def test_a_vocabulary_wider_than_a_chunk_is_taken_a_row_at_a_time(monkeypatch):
    """A chunk of fewer logits than one row has (a vocabulary past CHUNK_ELEMENTS) still holds a
    row: loss, gradients and scores as over the whole logits."""
    monkeypatch.setattr(archlab.loss, "CHUNK_ELEMENTS", 20)  # a row has 50
    hidden = torch.randn(9, 16, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(50, 16, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 50, (9,))
    targets[2] = IGNORE
    got = []
    for loss_of in (linear_cross_entropy, reference):
        loss = loss_of(hidden, weight, targets)
        loss.backward()
        got.append((loss.detach(), hidden.grad.clone(), weight.grad.clone()))
        hidden.grad = weight.grad = None
    for a, b in zip(*got):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert scores(hidden.detach(), weight.detach(), targets)[0].item() == pytest.approx(got[1][0].item() * 8, rel=1e-12)


def test_under_bfloat16_autocast_the_head_product_is_bfloat16s():
    """The loss is that of the logits autocast makes (a bfloat16 product), not of float32 ones."""
    gen = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(64, 32, generator=gen), torch.randn(300, 32, generator=gen)
    targets = torch.randint(0, 300, (64,), generator=gen)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = linear_cross_entropy(hidden, weight, targets)
        summed = scores(hidden, weight, targets)[0]
    expected = F.cross_entropy((hidden.bfloat16() @ weight.bfloat16().T).float(), targets)
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(summed, expected * 64, rtol=1e-6, atol=1e-5)
    assert abs(loss - reference(hidden, weight, targets)) > 1e-3  # float32's differs


@pytest.mark.parametrize("name", ["yoco-u", "parscale", "yoco-u-moe"])
def test_the_model_gives_the_loss_of_its_logits(name):
    """Every parameter's gradient, through the head (and ParScale's stream mixing, MoE's aux loss)."""
    spec, model = tiny_model(name)
    model = model.double()
    tokens = torch.randint(0, spec.vocab_size, (2, 24))
    targets = torch.randint(0, spec.vocab_size, (2, 24))
    targets[0, :5] = IGNORE
    loss, aux = model(tokens, return_aux=True, targets=targets)
    (loss + aux).backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    logits, aux = model(tokens, return_aux=True)
    expected = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE)
    (expected + aux).backward()
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-12)
    for n, p in model.named_parameters():
        torch.testing.assert_close(got[n], p.grad, rtol=1e-10, atol=1e-12, msg=n)


def test_a_negative_target_other_than_ignore_is_out_of_range_as_cross_entropy_says():
    """-1 (a common padding value) was clamped to token 0 and trained on as it."""
    hidden, weight = torch.randn(3, 8, dtype=torch.float64), torch.randn(5, 8, dtype=torch.float64)
    for wrong in (-1, 5):
        with pytest.raises((IndexError, RuntimeError), match="out of bounds"):
            F.cross_entropy(hidden @ weight.T, torch.tensor([wrong, 0, 0]))  # the reference refuses it
        with pytest.raises(RuntimeError, match="out of bounds"):
            linear_cross_entropy(hidden, weight, torch.tensor([wrong, 0, IGNORE]))


@pytest.mark.parametrize("given,error,said", [
    ([[1, 2]], TypeError, "input_ids must be a tensor of integer token ids, got list"),
    (torch.ones(1, 4), TypeError, "input_ids must be a tensor of integer token ids, got torch.float32"),
    (torch.ones(4, dtype=torch.long), ValueError, r"input_ids must be \[batch, length\] with a length of at least 1, got shape \(4,\)"),
    (torch.ones(1, 0, dtype=torch.long), ValueError, r"got shape \(1, 0\)"),
])
def test_the_model_names_token_ids_it_cannot_take(given, error, said):
    _, model = tiny_model("yoco-u")
    with pytest.raises(error, match=said):
        model(given)
    tokens = torch.ones(2, 4, dtype=torch.long)
    with pytest.raises(ValueError, match=r"targets must have input_ids' shape \(2, 4\), got \(2, 3\)"):
        model(tokens, targets=tokens[:, 1:])
