"""tools/slurm_cluster.sh gives its node every CPU this process may run on, whatever OMP_NUM_THREADS says.

tools/test.sh exports OMP_NUM_THREADS=1 before it starts the cluster, and GNU nproc obeys it: the node
then had CPUs=1, and every job asking for the node's CPUs (slurm/lib.sh's steps, tests/slurm) pended
until its time-out. No cluster is started here (`conf` only prints the slurm.conf that `start` writes)."""
import os
import re
import subprocess

from tests.slurm.conftest import ROOT


def test_node_cpus_ignore_omp_num_threads(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", OMP_THREAD_LIMIT="1", MTEPO_SLURM_DIR=str(tmp_path))
    res = subprocess.run(["bash", str(ROOT / "tools" / "slurm_cluster.sh"), "conf"], capture_output=True,
                         text=True, env=env, timeout=60)
    assert res.returncode == 0, res.stderr
    node = [line for line in res.stdout.splitlines() if line.startswith("NodeName=")]
    assert len(node) == 1, res.stdout
    cpus = int(re.search(r"\bCPUs=(\d+)", node[0]).group(1))
    assert cpus == len(os.sched_getaffinity(0)), node[0]
