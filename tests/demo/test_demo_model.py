"""The demo's building blocks: corpus, tokenizer, model and per-rank batch streams."""

import itertools
import math

import pytest
import torch

from fused_zero.demo.model import GPT, CharTokenizer, GPTConfig, batches, load_corpus, param_count


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Ops this small are fastest on one thread; with several, OpenMP contention on a busy CI box
    can make each matmul orders of magnitude slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def corpus():
    return load_corpus()


@pytest.fixture(scope="module")
def tok(corpus):
    return CharTokenizer(corpus)


@pytest.fixture(scope="module")
def data(corpus, tok):
    return tok.encode(corpus)


def test_corpus_loads(corpus):
    assert len(corpus.encode("utf-8")) > 50_000
    assert "Four score and seven years ago" in corpus


def test_tokenizer_round_trip(corpus, tok):
    assert tok.vocab_size == len(set(corpus))
    assert tok.chars == sorted(tok.chars)
    sample = corpus[1000:3000]
    ids = tok.encode(sample)
    assert ids.dtype == torch.long and ids.shape == (len(sample),)
    assert tok.decode(ids) == sample
    assert tok.decode(ids.tolist()) == sample
    assert CharTokenizer(corpus).encode(sample).equal(ids)  # ids depend on the text alone


def test_forward_shapes_and_initial_loss(tok, data):
    cfg = GPTConfig(vocab_size=tok.vocab_size)
    model = GPT(cfg)
    x, y = next(batches(data, batch_size=4, block_size=cfg.block_size, rank=0, world_size=1, seed=0))
    logits, loss = model(x, y)
    assert logits.shape == (4, cfg.block_size, tok.vocab_size)
    assert torch.isfinite(loss)
    assert abs(loss.item() - math.log(tok.vocab_size)) < 0.1
    logits, loss = model(x[:, :10])
    assert logits.shape == (4, 10, tok.vocab_size) and loss is None
    with pytest.raises(ValueError):
        model(torch.zeros(1, cfg.block_size + 1, dtype=torch.long))


def test_weight_tying_is_a_shared_parameter(tok):
    model = GPT(GPTConfig(vocab_size=tok.vocab_size))
    assert model.lm_head.weight is model.tok_emb.weight
    assert sum(p is model.tok_emb.weight for p in model.parameters()) == 1
    untied = GPT(GPTConfig(vocab_size=tok.vocab_size, tie_weights=False))
    assert untied.lm_head.weight is not untied.tok_emb.weight
    assert param_count(untied) == param_count(model) + tok.vocab_size * 64


def test_init_is_deterministic(tok):
    cfg = GPTConfig(vocab_size=tok.vocab_size)
    torch.manual_seed(123)
    a = GPT(cfg).state_dict()
    torch.manual_seed(123)
    b = GPT(cfg).state_dict()
    assert all(a[k].equal(b[k]) for k in a)


def test_batches_deterministic_per_rank(data):
    def take(rank, seed, n=3):
        it = batches(data, batch_size=8, block_size=32, rank=rank, world_size=2, seed=seed)
        return list(itertools.islice(it, n))

    r0, r0_again, r1, other_seed = take(0, 7), take(0, 7), take(1, 7), take(0, 8)
    for (x, y), (x2, y2) in zip(r0, r0_again):
        assert x.equal(x2) and y.equal(y2)
    assert not any(x.equal(x1) for (x, _), (x1, _) in zip(r0, r1))
    assert not any(x.equal(xs) for (x, _), (xs, _) in zip(r0, other_seed))
    x, y = r0[0]
    assert x.shape == y.shape == (8, 32) and x.dtype == torch.long
    assert x[:, 1:].equal(y[:, :-1])  # targets are the inputs shifted by one
    torch.manual_seed(999)  # the global RNG does not affect the stream
    assert take(0, 7, 1)[0][0].equal(r0[0][0])
    with pytest.raises(ValueError):
        next(batches(data, batch_size=1, block_size=8, rank=2, world_size=2, seed=0))


def test_adamw_reduces_loss_on_fixed_batch(tok, data):
    cfg = GPTConfig(vocab_size=tok.vocab_size, block_size=32)
    model = GPT(cfg)
    x, y = next(batches(data, batch_size=8, block_size=32, rank=0, world_size=1, seed=0))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(15):
        _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5, losses


def test_generate_extends_sequence(tok):
    model = GPT(GPTConfig(vocab_size=tok.vocab_size, block_size=16)).eval()
    out = model.generate(tok.encode("To be").unsqueeze(0), 20, generator=torch.Generator().manual_seed(0))
    assert out.shape == (1, 25)
    assert tok.decode(out[0]).startswith("To be")
