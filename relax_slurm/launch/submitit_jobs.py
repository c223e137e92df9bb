"""submitit's Slurm executor and job, made to read a heterogeneous job's sacct rows.

submitit 1.5 has no het-job option and reads sacct's `<id>+<k>` rows of a het job as unknown
jobs (it would report such a job as UNKNOWN forever); `job_classes` returns an executor whose
jobs take component 0's row as the job's state. Used by `relax_slurm.submit` (launch/submit.py)
and the engine jobs (launch/engine_job.py). submitit is imported when it is called.
"""

from __future__ import annotations


def job_classes():
    """submitit's Slurm executor and job, made to read het jobs' sacct rows (`<id>+<k>`)."""
    from submitit.slurm.slurm import SlurmExecutor, SlurmInfoWatcher, SlurmJob

    class HetInfoWatcher(SlurmInfoWatcher):
        def read_info(self, string: bytes | str) -> dict[str, dict[str, str]]:
            text = string.decode() if isinstance(string, bytes) else string
            rows = []
            for line in text.splitlines():
                job_id, sep, rest = line.partition("|")
                if "+" in job_id:  # component rows: the job's state is component 0's
                    base, _, comp = job_id.partition("+")
                    if comp != "0":
                        continue
                    line = base + sep + rest
                rows.append(line)
            return super().read_info("\n".join(rows))

    class RelaxJob(SlurmJob):
        watcher = HetInfoWatcher(delay_s=60)

    class RelaxExecutor(SlurmExecutor):
        job_class = RelaxJob

    return RelaxExecutor
