"""The one option parser: ``read_options`` and the configs' ``from_options``.

Every integration reads its settings through these, so each rule here holds for a YAML
section, callback keyword arguments and ``SWAPOPT_*`` variables alike.
"""

from __future__ import annotations

import pytest

from swapopt_core import OffloadConfig, SwapOptimizerConfig, runtime_names
from swapopt_core.options import (
    NO,
    YES,
    Invalid,
    Option,
    parse_bool,
    parse_int,
    parse_mib,
    parse_name_list,
    read_options,
)

# ---- the parsers ----------------------------------------------------------------------------


@pytest.mark.parametrize("word", [*YES, *(w.upper() for w in YES), " yes "])
def test_yes_words(word: str) -> None:
    assert parse_bool(word) is True


@pytest.mark.parametrize("word", [*NO, *(w.upper() for w in NO), " off "])
def test_no_words(word: str) -> None:
    assert parse_bool(word) is False


@pytest.mark.parametrize("value", ["maybe", "", "2", 1, 0, None, 1.0])
def test_bool_rejects_other_values(value: object) -> None:
    with pytest.raises(Invalid):
        parse_bool(value)


def test_bool_takes_bools_as_they_are() -> None:
    assert (parse_bool(True), parse_bool(False)) == (True, False)


@pytest.mark.parametrize(("value", "want"), [(3, 3), ("3", 3), (" 12 ", 12), ("1", 1)])
def test_int_accepts_ints_and_their_text(value: object, want: int) -> None:
    assert parse_int(1)(value) == want


@pytest.mark.parametrize("value", [0, "0", "-1", "1.5", 1.0, True, "eight", None, ""])
def test_int_rejects_the_rest(value: object) -> None:
    with pytest.raises(Invalid):
        parse_int(1)(value)


@pytest.mark.parametrize(("value", "want"), [(2, 2.0), ("1.5", 1.5), (" 0 ", 0.0), (0.25, 0.25)])
def test_mib_accepts_numbers_and_text(value: object, want: float) -> None:
    assert parse_mib(allow_none=False)(value) == want


@pytest.mark.parametrize("value", ["-1", -0.5, "inf", "nan", "lots", True, None, "none"])
def test_mib_rejects_the_rest(value: object) -> None:
    with pytest.raises(Invalid):
        parse_mib(allow_none=False)(value)


@pytest.mark.parametrize("value", [None, "none", "NULL", "", " "])
def test_mib_none_words_where_allowed(value: object) -> None:
    assert parse_mib(allow_none=True)(value) is None


@pytest.mark.parametrize(
    ("value", "want"),
    [
        ("exp_avg,exp_avg_sq", ("exp_avg", "exp_avg_sq")),
        (" exp_avg , exp_avg_sq ", ("exp_avg", "exp_avg_sq")),
        ("exp_avg", ("exp_avg",)),
        (["exp_avg_sq", "exp_avg"], ("exp_avg_sq", "exp_avg")),
        (("exp_avg",), ("exp_avg",)),
        (None, None),
        ("none", None),
    ],
)
def test_name_list_reads_lists_and_comma_separated_text(value: object, want: object) -> None:
    assert parse_name_list(lambda: ("exp_avg", "exp_avg_sq"))(value) == want


@pytest.mark.parametrize(
    "value", [[], "", "exp_avg,", "exp_avg,exp_avg", ["exp_avg", 3], ["m"], "m", 5]
)
def test_name_list_rejects_the_rest(value: object) -> None:
    with pytest.raises(Invalid):
        parse_name_list(lambda: ("exp_avg", "exp_avg_sq"))(value)


# ---- read_options ---------------------------------------------------------------------------

_OPTIONS = {
    "count": Option(parse_int(1), "an integer >= 1"),
    "flag": Option(parse_bool, "a boolean"),
    "mode": Option(lambda v: v, "one of {choices}", lambda: ("b", "a")),
}


def test_read_options_converts_only_what_is_given() -> None:
    assert read_options(_OPTIONS, {"count": "4", "flag": "on"}, source="s") == {
        "count": 4,
        "flag": True,
    }


def test_unknown_option_lists_the_accepted_ones() -> None:
    with pytest.raises(ValueError, match=r"^s has no option 'cuont'; accepted options: \['count',"):
        read_options(_OPTIONS, {"cuont": 4}, source="s")


def test_non_mapping_is_refused_with_the_accepted_options() -> None:
    with pytest.raises(ValueError, match=r"s must be a mapping.*got \[1\]\. Accepted options"):
        read_options(_OPTIONS, [1], source="s")  # type: ignore[arg-type]


def test_bad_value_names_source_field_value_and_accepted() -> None:
    with pytest.raises(ValueError) as info:
        read_options(_OPTIONS, {"count": "0"}, source="section")
    assert str(info.value) == "section.count='0' is invalid; accepted: an integer >= 1."


def test_labels_rename_a_field_in_errors() -> None:
    with pytest.raises(ValueError, match=r"^environment variable X=2 is invalid; accepted: a boo"):
        read_options(_OPTIONS, {"flag": 2}, source="s", labels={"flag": "environment variable X"})


def test_choices_are_listed_sorted_when_asked() -> None:
    assert _OPTIONS["mode"].describe() == "one of ['a', 'b']"


# ---- SwapOptimizerConfig.from_options -------------------------------------------------------


def test_swap_config_from_text_everywhere() -> None:
    config = SwapOptimizerConfig.from_options(
        {
            "swap_times": "8",
            "state_keys": "exp_avg, exp_avg_sq",
            "min_numel": "0",
            "include_master_params": "no",
            "packed_swap": "off",
            "runtime": "loopback",
        },
        framework="torch",
    )
    assert config == SwapOptimizerConfig(
        swap_times=8,
        state_keys=("exp_avg", "exp_avg_sq"),
        min_numel=0,
        include_master_params=False,
        packed_swap=False,
        runtime="loopback",
    )


@pytest.mark.parametrize(("value", "want"), [("auto", None), (None, None), ("yes", True)])
def test_packed_swap_auto_means_the_runtime_default(value: object, want: object) -> None:
    assert SwapOptimizerConfig.from_options({"packed_swap": value}).packed_swap is want


def test_fields_not_given_keep_the_base() -> None:
    base = SwapOptimizerConfig(swap_times=3, runtime="loopback")
    assert SwapOptimizerConfig.from_options({"min_numel": 5}, base=base) == SwapOptimizerConfig(
        swap_times=3, min_numel=5, runtime="loopback"
    )
    assert SwapOptimizerConfig.from_options({}) == SwapOptimizerConfig()


def test_runtime_checked_against_the_framework() -> None:
    with pytest.raises(ValueError) as info:
        SwapOptimizerConfig.from_options({"runtime": "ascend"}, source="cb", framework="torch")
    assert "cb.runtime='ascend' is invalid" in str(info.value)
    assert str(runtime_names("torch")) in str(info.value)
    assert SwapOptimizerConfig.from_options({"runtime": "ascend"}, framework="mindspore").runtime
    # Without a framework any name passes here; it is looked up at install.
    assert SwapOptimizerConfig.from_options({"runtime": "mine"}).runtime == "mine"


def test_state_keys_checked_against_the_families() -> None:
    with pytest.raises(ValueError) as info:
        SwapOptimizerConfig.from_options(
            {"state_keys": "exp_avg,momentum"}, source="swap_optimizer", framework="mindspore"
        )
    message = str(info.value)
    assert "swap_optimizer.state_keys='exp_avg,momentum' is invalid" in message
    assert "['exp_avg', 'exp_avg_sq', 'max_exp_avg_sq', 'momentum_buffer', 'stat']" in message


def test_swap_config_unknown_field_lists_the_fields() -> None:
    with pytest.raises(ValueError, match=r"has no option 'swaptimes'.*'swap_times'"):
        SwapOptimizerConfig.from_options({"swaptimes": 8})


@pytest.mark.parametrize(
    ("field", "value", "accepted"),
    [
        ("swap_times", "0", "an integer >= 1"),
        ("swap_times", True, "an integer >= 1"),
        ("min_numel", "-1", "an integer >= 0"),
        ("include_master_params", "maybe", "a boolean (1/true/yes"),
        ("packed_swap", 2, "'auto'"),
        ("state_keys", [], "null, or distinct"),
        ("runtime", "", "a runtime name"),
    ],
)
def test_swap_config_bad_values_are_named(field: str, value: object, accepted: str) -> None:
    with pytest.raises(ValueError) as info:
        SwapOptimizerConfig.from_options({field: value}, source="src")
    assert f"src.{field}={value!r} is invalid" in str(info.value)
    assert accepted in str(info.value)


# ---- OffloadConfig.from_options -------------------------------------------------------------


def test_offload_config_from_text() -> None:
    config = OffloadConfig.from_options(
        {
            "max_resident_activation_mb": "0.5",
            "max_offload_activation_mb": 64,
            "planner": "timed",
            "runtime": "loopback",
            "min_offload_kib": "0",
        }
    )
    assert config == OffloadConfig(
        max_resident_activation_mb=0.5,
        max_offload_activation_mb=64,
        planner="timed",
        runtime="loopback",
        min_offload_kib=0,
    )
    assert OffloadConfig.from_options({}) == OffloadConfig()


@pytest.mark.parametrize(
    ("field", "value", "accepted"),
    [
        ("max_resident_activation_mb", "-1", "a number of MiB >= 0"),
        ("max_offload_activation_mb", "none", "a number of MiB >= 0"),
        ("min_offload_kib", "lots", "a number of KiB >= 0"),
        ("runtime", "tpu", "one of ['auto', 'cuda', 'loopback', 'loopback-async']"),
        ("planner", "", "a registered planner name"),
    ],
)
def test_offload_config_bad_values_are_named(field: str, value: object, accepted: str) -> None:
    with pytest.raises(ValueError) as info:
        OffloadConfig.from_options({field: value}, labels={field: "FLAG"})
    assert f"FLAG={value!r} is invalid" in str(info.value) and accepted in str(info.value)


def test_offload_config_unknown_field() -> None:
    with pytest.raises(ValueError, match=r"OffloadConfig has no option 'budget'.*'planner'"):
        OffloadConfig.from_options({"budget": 1})


# ---- sizes that cannot be held in bytes (issue 10) ------------------------------------------


@pytest.mark.parametrize("value", [1e308, "1e308", 2.0**43, "9e15"])
def test_mib_rejects_sizes_whose_bytes_overflow_int64(value: object) -> None:
    with pytest.raises(Invalid):
        parse_mib(allow_none=False)(value)


def test_kib_limit_is_in_kib() -> None:
    assert parse_mib(allow_none=False, unit=2**10)(2.0**43) == 2.0**43
    with pytest.raises(Invalid):
        parse_mib(allow_none=False, unit=2**10)(2.0**53)


@pytest.mark.parametrize(
    ("field", "variable"),
    [
        ("max_resident_activation_mb", "SWAPOPT_ACTIVATION_BUDGET_MB"),
        ("max_offload_activation_mb", "FLAG"),
        ("min_offload_kib", "FLAG"),
    ],
)
@pytest.mark.parametrize("value", ["1e308", 1e308, float("inf"), "inf"])
def test_offload_config_from_options_refuses_absurd_sizes(
    field: str, variable: str, value: object
) -> None:
    with pytest.raises(ValueError) as info:
        OffloadConfig.from_options({field: value}, labels={field: variable})
    assert f"{variable}={value!r} is invalid" in str(info.value)
    assert "below" in str(info.value)
