"""What the device tests share: a function run in another thread, bounded."""
import threading


def in_thread(fn, timeout: float = 60.0):
    """fn() run in another thread, its result (or its exception raised here); an error if it has not ended within
    `timeout` seconds (a test must fail, not hang)."""
    out = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 -- handed to the caller
            out["error"] = e
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        raise TimeoutError(f"{fn!r} still running in its thread after {timeout} s")
    if "error" in out:
        raise out["error"]
    return out["value"]
