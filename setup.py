from setuptools import find_packages, setup

setup(
    name="fastdeploy_ext",
    version="0.1.0",
    description="MiniMax-M1 and MiDashengLM on a FastDeploy-style PaddlePaddle engine",
    packages=find_packages(include=["fastdeploy_ext", "fastdeploy_ext.*"]),
    package_data={"fastdeploy_ext": ["ops/*/README.md", "tiny/templates/*.jinja", "tiny/templates/LICENSE.*"]},
    python_requires=">=3.10",
    install_requires=[
        "numpy",
        "safetensors>=0.4",
        "tokenizers>=0.19",
        "jinja2",
        "tqdm",
        "pyyaml",
        "soundfile",
        "soxr",
        "threadpoolctl",
        # `serve` is a documented subcommand: the server packages belong to the main install.
        "fastapi",
        "uvicorn",
        # structured outputs and tool_choice enforcement: grammar -> token bitmasks (Rust, NumPy, no torch)
        "llguidance>=1.9",
    ],
    extras_require={
        "cpu": ["paddlepaddle==3.3.1"],
        "triton": ["triton==3.6.0"],
        "align": ["torch==2.13.0", "transformers", "matplotlib", "dasheng==0.0.9"],
        "test": [
            "pytest",
            "pytest-timeout",
            "torch==2.13.0",
            "transformers",
            "triton==3.6.0",
            "librosa",
            "dasheng==0.0.9",
            "matplotlib",
            "openai",
            "httpx",
            "schemathesis==4.32.5",
            # lm-eval's local-completions loglikelihood/generate_until against the server vs its hf backend
            "lm-eval[api,hf]==0.4.13",
            # validates tool-call arguments and structured outputs against their schemas
            "jsonschema",
        ],
    },
    entry_points={"console_scripts": ["fastdeploy-ext=fastdeploy_ext.entrypoints.cli:main"]},
)
