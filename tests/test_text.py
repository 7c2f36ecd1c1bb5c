"""StreamDecoder: streamed text equals the one-shot decode, stop strings cut where they start,
and a long stream costs linear decoding work."""

from __future__ import annotations

import random

import pytest

from speculant.core.text import StreamDecoder
from speculant.embedded import PAIR_DIR


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(PAIR_DIR / "target"))


class CountingTokenizer:
    """The real tokenizer, counting how many ids each decode is asked for."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.decoded_ids = 0

    def decode(self, ids, **kwargs):
        self.decoded_ids += len(ids)
        return self.inner.decode(ids, **kwargs)


def stream(decoder: StreamDecoder, ids: list[int], rng: random.Random) -> tuple[str, int | None]:
    out, i = [], 0
    while i < len(ids):
        n = rng.randint(1, 8)
        text, hit = decoder.feed(ids[i : i + n])
        out.append(text)
        i += n
        if hit is not None:
            return "".join(out), hit
    out.append(decoder.flush())
    return "".join(out), None


def mixed_ids(tokenizer, rng: random.Random, n: int) -> list[int]:
    """Code, multi-byte characters split across byte tokens, and random vocabulary ids."""
    text = "def f(x):\n    return x  # héllo 世界 🙂 ünïcode\n" * 3
    ids = tokenizer.encode(text, add_special_tokens=False)
    ids += [rng.randrange(2, tokenizer.vocab_size) for _ in range(n)]
    rng.shuffle(ids)
    return ids


@pytest.mark.parametrize("seed", range(20))
def test_streamed_text_equals_the_one_shot_decode(tokenizer, seed):
    rng = random.Random(seed)
    ids = mixed_ids(tokenizer, rng, 60)
    text, hit = stream(StreamDecoder(tokenizer), ids, rng)
    assert hit is None
    assert text == tokenizer.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("seed", range(20))
def test_stop_string_cuts_where_it_first_starts(tokenizer, seed):
    rng = random.Random(seed)
    ids = tokenizer.encode("import os\nimport sys\n\ndef main(argv):\n    return len(argv)\n" * 2, add_special_tokens=False)
    full = tokenizer.decode(ids, skip_special_tokens=True)
    start = rng.randrange(1, len(full) - 6)
    stop = full[start : start + rng.randint(2, 6)]
    decoder = StreamDecoder(tokenizer, [stop])
    text, hit = stream(decoder, ids, rng)
    assert hit is not None and text == full[: full.find(stop)]
    kept = decoder.token_count_for_stop()
    assert stop in tokenizer.decode(ids[:kept]) and stop not in tokenizer.decode(ids[: kept - 1])


def test_a_long_stream_decodes_each_token_a_bounded_number_of_times(tokenizer):
    rng = random.Random(0)
    ids = mixed_ids(tokenizer, rng, 3000)
    counting = CountingTokenizer(tokenizer)
    decoder = StreamDecoder(counting, ["\x00never"])
    pieces = [decoder.feed([t])[0] for t in ids] + [decoder.flush()]
    assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True)
    # re-decoding everything on each feed would be about len(ids)**2 / 2 ids
    assert counting.decoded_ids < 20 * len(ids)
