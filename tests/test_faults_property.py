"""Property: whatever config dict or per-call settings a user writes, the engine either runs or
raises speculant's own error naming the field at fault, never another exception."""

from __future__ import annotations

import math
import re

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import speculant
from speculant.core.errors import SpeculantError

ODD = st.one_of(st.none(), st.booleans(), st.integers(-3, 12), st.sampled_from([-1.5, 0.0, 0.5, 2.0, math.nan, math.inf]),
                st.text(max_size=4), st.lists(st.integers(-2, 400), max_size=3), st.dictionaries(st.text(max_size=3), st.integers(), max_size=1))
CONFIG_MAX = 5
FIELD = re.compile(r"\b(backend|target|drafter|verifier|sampling|generation)\.[a-z_]+|\bplugins\b|\bprompt(_ids)?\b")


def _one_in(n: int, odd, usual):
    """``odd`` about once in ``n`` draws (a middle value of the roll: hypothesis favours the ends)."""
    return st.tuples(st.integers(0, n - 1), odd, usual).map(lambda t: t[1] if t[0] == n // 2 else t[2])


def maybe(strategy):
    """A plausible value most of the time, anything some of the time."""
    return _one_in(6, ODD, strategy)


def rarely(value) -> st.SearchStrategy[dict]:
    """``value`` (an unknown key) in about one example of ten, else nothing."""
    return _one_in(10, st.just(value), st.just({}))


def section(**fields) -> st.SearchStrategy[dict]:
    return st.fixed_dictionaries({}, optional={k: maybe(v) for k, v in fields.items()})


def configs(target: str, draft: str) -> st.SearchStrategy[dict]:
    known = st.fixed_dictionaries(
        {
            "target": st.fixed_dictionaries({"path": st.sampled_from([target] * 6 + ["/nonexistent/model", draft])}),
            "generation": st.fixed_dictionaries(
                {"max_new_tokens": maybe(st.integers(1, 5))},  # 0 and -1 come with the odd values
                optional={"stop_token_ids": maybe(st.lists(st.integers(-1, 400), max_size=2)),
                          "stop_strings": maybe(st.lists(st.text(max_size=2), max_size=2)),
                          "ignore_eos": maybe(st.booleans())}),
        },
        optional={
            "backend": section(kind=st.sampled_from(["torch"] * 3 + ["mlx"] * 2 + ["nope"]),
                               device=st.sampled_from(["cpu"] * 4 + ["auto", "tpu", "cuda:7", "gpu"]),
                               dtype=st.sampled_from(["float32"] * 4 + ["auto", "int8"])),
            "drafter": section(kind=st.sampled_from([None, "none"] + ["dflash"] * 4 + ["dflash2", "mtp", "eagle9"]),
                               path=st.sampled_from([draft] * 6 + ["/nonexistent/draft"]),
                               block_size=st.integers(-1, 20),
                               quantization=st.sampled_from([None, "w8", "w3", "junk"]),
                               lookup=st.one_of(st.booleans(), section(enabled=st.booleans(), min_match=st.integers(-1, 9),
                                                                       max_match=st.integers(-1, 9))),
                               options=rarely({"widht": 3})),
            "verifier": section(kind=st.sampled_from(["auto"] * 3 + ["greedy", "speculative_sampling", "adaptive", "zzz"]),
                                options=rarely({"x": 1})),
            "sampling": section(temperature=st.sampled_from([0.0, 0.7, -1.0, math.nan, math.inf]),
                                top_p=st.sampled_from([1.0, 0.9, 0.0, 1.5, math.nan]), top_k=st.integers(-2, 50),
                                seed=st.one_of(st.none(), st.integers(-5, 2**70))),
        },
    )
    return st.tuples(known, rarely({"sprinkles": {}})).map(lambda pair: {**pair[0], **pair[1]})


def overrides() -> st.SearchStrategy[dict]:
    return st.fixed_dictionaries(
        {"prompt_ids": maybe(st.lists(_one_in(8, st.sampled_from([-2, 400, 1.5, True]), st.integers(0, 300)),
                                      min_size=1, max_size=4)),
         "max_new_tokens": maybe(st.integers(1, 5))},
        optional={"temperature": st.sampled_from([0.0, 0.8, -1.0, math.nan, math.inf, "hot"]),
                  "top_p": st.sampled_from([1.0, 0.5, 0.0, 2.0, math.nan]), "top_k": st.integers(-2, 40),
                  "seed": st.one_of(st.none(), st.integers(-5, 2**70), st.just(1.5)),
                  "block_size": maybe(st.integers(-1, 20)), "stop_token_ids": maybe(st.lists(st.integers(-1, 400), max_size=2)),
                  "stop_strings": maybe(st.lists(st.text(max_size=2), max_size=2)),
                  "ignore_eos": maybe(st.booleans())},
    ).flatmap(lambda kwargs: rarely({"tempreature": 0.5}).map(lambda extra: {**kwargs, **extra}))


def assert_names_a_field(exc: BaseException) -> None:
    assert isinstance(exc, SpeculantError), f"{type(exc).__name__}: {exc}"
    problems = getattr(exc, "problems", None)
    if problems:
        assert all(p.field for p in problems), problems
    elif not getattr(exc, "field", None):
        assert FIELD.search(str(exc)), f"{type(exc).__name__} names no field: {exc}"


@pytest.fixture(scope="module")
def paths(planted_pair):
    return str(planted_pair["target"]), str(planted_pair["draft"])


@pytest.fixture(scope="module")
def engine(planted_pair):
    return speculant.load_engine({
        "backend": {"kind": "torch", "device": "cpu", "dtype": "float32"}, "target": {"path": str(planted_pair["target"])},
        "drafter": {"kind": "dflash", "path": str(planted_pair["draft"]), "lookup": True},
        "generation": {"max_new_tokens": CONFIG_MAX},  # what max_new_tokens=None leaves
    })


@pytest.fixture(autouse=True)
def builtins_only(monkeypatch):
    monkeypatch.setenv("SPECULANT_LOAD_PLUGINS", "")


@pytest.mark.filterwarnings("ignore")
def test_random_configs_run_or_name_the_field(paths):
    @settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(configs(*paths))
    def check(config: dict) -> None:
        try:
            engine = speculant.load_engine(config)
            result = engine.run(prompt_ids=[5, 6, 7])
        except Exception as exc:  # noqa: BLE001 - the property is about which exceptions come out
            assert_names_a_field(exc)
            return
        assert 1 <= len(result.token_ids) <= engine.config.generation.max_new_tokens

    check()


def test_random_overrides_run_or_name_the_field(engine):
    @settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(overrides())
    def check(kwargs: dict) -> None:
        try:
            result = engine.run(**kwargs)
        except Exception as exc:  # noqa: BLE001
            assert_names_a_field(exc)
            return
        limit = kwargs["max_new_tokens"] if kwargs["max_new_tokens"] is not None else CONFIG_MAX
        assert 1 <= len(result.token_ids) <= limit

    check()
