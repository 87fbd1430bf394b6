"""BuildReport's reading of its failures (pure)."""

from __future__ import annotations

from featbake.bake.report import BuildReport, FailureCause
from featbake.errors import EncodeError, SourceError


def _report(files: int, failed: list[tuple[str, str]]) -> BuildReport:
    return BuildReport("root", "data", "enc", "fp", "rfp", files=files, failed=failed)


def test_every_input_failing_alike_is_one_common_failure() -> None:
    failed = [
        ("a.wav", "a.wav: the encoder failed on a batch of shape (1, 1, 4800): bad input"),
        ("sub/b.wav", "sub/b.wav: the encoder failed on a batch of shape (1, 1, 16000): bad input"),
    ]
    assert _report(2, failed).common_failure() == (
        "the encoder failed on a batch of shape (1, 1, 4800): bad input"
    )


def test_failures_that_differ_or_leave_inputs_stored_are_the_inputs_fault() -> None:
    alike = [("a.wav", "a.wav: cannot decode audio"), ("b.wav", "b.wav: cannot decode audio")]
    assert _report(3, alike).common_failure() is None  # a third input was stored
    differ = [("a.wav", "a.wav: cannot decode audio"), ("b.wav", "b.wav: the file is empty")]
    assert _report(2, differ).common_failure() is None
    assert _report(1, alike[:1]).common_failure() is None  # one input says nothing
    assert _report(0, []).common_failure() is None


def test_the_common_cause_is_the_one_every_recorded_failure_has() -> None:
    """Round four item 14: the summary's advice follows whose failures they are."""
    assert FailureCause.of(EncodeError("x")) is FailureCause.ENCODER
    assert FailureCause.of(SourceError("x")) is FailureCause.DATA
    report = _report(2, [])
    report.fail("a.wav", "a.wav: cannot stat", FailureCause.DATA)
    assert report.common_cause() is FailureCause.DATA
    report.fail("b.wav", "b.wav: the encoder failed", FailureCause.ENCODER)
    assert report.common_cause() is None  # they differ
    assert [f["cause"] for f in report.to_json()["failed"]] == ["data", "encoder"]
    unrecorded = _report(1, [("a.wav", "a.wav: cannot stat")])
    assert unrecorded.common_cause() is None and unrecorded.to_json()["failed"][0]["cause"] is None
    assert _report(0, []).common_cause() is None


def test_progress_lines_are_labelled_and_show_no_rate_over_a_blink() -> None:
    from featbake.progress import MIN_RATE_SECONDS, progress_line, rate_text

    assert rate_text(1_000_000, 0.001) == "-"  # was "1,000,000,000 items/s"
    assert rate_text(100, MIN_RATE_SECONDS) == "200 items/s"
    assert progress_line("hash", 16, 16, 0.002) == "hash: 16/16, done in 0.00s"
    assert progress_line("encode", 40, 160, 8.0, "3.0 MiB") == (
        "encode: 40/160, 5 items/s, elapsed 8s, ETA 24s, 3.0 MiB sealed"
    )
    # Issue 32 item 1: what a SIGKILL would lose is named apart from what survives it.
    assert progress_line("encode", 40, 160, 8.0, "", "954.81 KiB") == (
        "encode: 40/160, 5 items/s, elapsed 8s, ETA 24s, 0 B sealed, 954.81 KiB pending"
    )
    assert progress_line("encode", 160, 160, 32.0) == "encode: 160/160, 5 items/s, elapsed 32s"
    assert progress_line("encode", 1, 160, 0.1) == "encode: 1/160, -, elapsed 0s"
