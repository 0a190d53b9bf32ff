"""Figures in readable units: FLOP/s in TFLOP/s, GFLOP/s or MFLOP/s with three significant digits, never a zero for a
rate that is not zero, in every output that prints one (report, diff, the live console line)."""
import pytest

from ds_profutils.engine.live.sinks import console_line
from ds_profutils.report import build_report
from ds_profutils.report.text import render_text
from ds_profutils.units import flops_rate, share

from report_testing import iteration_record, write_records


@pytest.mark.parametrize("tflops, shown", [
    (12.34, "12.3 TFLOP/s"), (2345.6, "2,350 TFLOP/s"), (0.5, "500 GFLOP/s"), (0.0012, "1.20 GFLOP/s"),
    (0.000412, "412 MFLOP/s"), (1e-9, "0.00100 MFLOP/s"), (999.96, "1,000 TFLOP/s"), (0.0009996, "1.00 GFLOP/s"),
    (0.0, "0 TFLOP/s"), (None, None), (float("nan"), None)])
def test_a_rate_is_shown_in_the_largest_unit_it_fills_with_three_significant_digits(tflops, shown):
    assert flops_rate(tflops) == shown


@pytest.mark.parametrize("fraction, shown", [(0.588, "58.8%"), (0.001, "0.100%"), (0.0000012, "0.000120%"),
                                              (1.0, "100%"), (0.0, "0%"), (None, None)])
def test_a_share_is_a_percentage_with_three_significant_digits_never_zero_when_it_is_not(fraction, shown):
    assert share(fraction) == shown


def test_a_cpu_jobs_rate_is_not_printed_as_zero_in_the_report_or_the_live_line(tmp_path):
    """3 GFLOP per 28 ms iteration: 0.000107 TFLOP/s, which ``{:.3f}`` printed as 0.000."""
    for rank in (0, 1):
        write_records(tmp_path, rank, [row for step in range(4) for row in iteration_record(rank, step, flops=3e9)])
    text = render_text(build_report(tmp_path))
    assert "107 GFLOP/s  0.107%" in text  # MFU against a peak of 100 TFLOP/s, three significant digits
    line = console_line([("ds_profutils/step_ms", 46.0, 4), ("ds_profutils/tflops", 0.0000588, 4)])
    assert line == "ds_profutils step 4: step 46.0 ms, 58.8 MFLOP/s"


def test_rank_ranges_one_function_for_the_reports_lines_and_the_records_group_keys():
    from ds_profutils.units import rank_ranges

    assert rank_ranges([9, 0, 1, 2, 3, 5, 7, 8, 3]) == "0-3, 5, 7-9"
    assert rank_ranges((0, 1, 2, 3, 8, 9), ",") == "0-3,8-9" and rank_ranges(range(1024), ",") == "0-1023"
    assert rank_ranges([]) == "none" and rank_ranges([4]) == "4"
