"""Spawned ranks' processes (engine/workers.py's, distributed/nodes.py's, ranks 1.. in order):
stopping them for sure, and the errors for one that died."""
import pickle

JOIN_TIMEOUT_S = 10  # a rank told to exit gets this long before it is killed


def stop_processes(processes, conns):
    """Ask every worker to exit, then make sure: terminate, kill, and reap (no zombies)."""
    for conn in conns:
        try:
            conn.send_bytes(pickle.dumps(None))
            conn.close()
        except (OSError, ValueError):
            pass
    for p in processes:
        p.join(JOIN_TIMEOUT_S)
        if p.is_alive():
            p.terminate()
            p.join(JOIN_TIMEOUT_S)
        if p.is_alive():
            p.kill()
            p.join()


def died_starting(rank: int, p) -> RuntimeError:
    return RuntimeError(
        f"tensor-parallel worker rank {rank} exited during start-up (exit code {p.exitcode}); "
        "see its error above. Scripts that use tensor_parallel_size > 1 must guard their "
        "entry point with `if __name__ == '__main__':`, as spawned processes re-import it")


def check_alive(processes):
    """A RuntimeError naming the first of the ranks 1.. in `processes` that has died."""
    for rank, p in enumerate(processes, start=1):
        if not p.is_alive():
            raise RuntimeError(f"tensor-parallel worker rank {rank} (pid {p.pid}) has died with exit code "
                               f"{p.exitcode}; this LLM cannot continue: shut it down and create a new one")
