"""`rollpacker.logs`: what the libraries print goes to the log file, rollpacker's own lines and the
libraries' errors to the terminal."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import warnings

from rollpacker.logs import console, library_output_to


def test_library_output_goes_to_the_log_file_and_rollpacker_lines_to_the_terminal(tmp_path, capfd) -> None:
    # as vLLM (and MLflow, transformers) configure their loggers at import: a handler bound to the
    # stdout of that moment, no propagation
    lib = logging.getLogger("test_library_logs.vllm")
    handler = logging.StreamHandler(sys.stdout)
    lib.addHandler(handler)
    lib.propagate = False
    lib.setLevel(logging.INFO)
    showwarning = warnings.showwarning
    log = tmp_path / "logs" / "arm.log"
    try:
        with library_output_to(log):
            lib.warning("W1 the engine's warning")
            warnings.warn("W2 a library's FutureWarning", FutureWarning, stacklevel=1)
            logging.getLogger("test_library_logs.torch").warning("W3 a propagating warning")
            os.write(2, b"W4 C++ code writing to descriptor 2\n")
            print("W5 a library's print")
            code = "import sys; print('W6 subprocess out'); print('W7 subprocess err', file=sys.stderr)"
            subprocess.run([sys.executable, "-c", code], check=True)
            print("rollpacker's progress line", file=console())
            logging.getLogger("test_library_logs.torch").error("a library's error")
    finally:
        lib.removeHandler(handler)
    out, err = capfd.readouterr()
    text = log.read_text()
    for line in ("W1", "W2", "W3", "W4", "W5", "W6", "W7", "a library's error"):
        assert line in text, (line, text)
    for line in ("W1", "W2", "W3", "W4", "W5", "W6", "W7"):
        assert line not in out + err, (line, out, err)
    assert "rollpacker's progress line" in err and "rollpacker's progress line" not in text
    assert "a library's error" in err  # errors still reach the terminal
    assert err.count(str(log)) == 1 and out == ""  # where the log is, said once
    # everything put back
    assert handler.stream is sys.stdout and warnings.showwarning is showwarning
    assert console() is sys.stderr
    print("after the block")
    assert capfd.readouterr().out == "after the block\n"


def test_a_failure_in_the_block_names_the_log_again(tmp_path, capfd) -> None:
    log = tmp_path / "x.log"
    try:
        with library_output_to(log):
            raise RuntimeError("engine failed")
    except RuntimeError:
        pass
    _, err = capfd.readouterr()
    assert err.count(str(log)) == 2 and "up to the failure" in err


def test_a_logger_holding_the_last_resort_handler_does_not_break_the_block(tmp_path) -> None:
    """Some libraries attach ``logging.lastResort`` (a stderr handler whose stream has no setter);
    it follows sys.stderr by itself, so the block leaves it alone instead of failing."""
    lib = logging.getLogger("test_library_logs.last_resort")
    lib.addHandler(logging.lastResort)
    try:
        with library_output_to(tmp_path / "x.log"):
            pass
    finally:
        lib.removeHandler(logging.lastResort)
