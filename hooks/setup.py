"""Ships shadowtrace_hooks.pth at the top of site-packages, beside the package: the line in it
activates tracing at interpreter start when SHADOWTRACE is set (see startup.py). Project
metadata lives in pyproject.toml."""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "shadowtrace_hooks.pth"


class BuildWithStartupHook(build_py):
    def run(self) -> None:
        super().run()
        target = Path(self.build_lib) / PTH
        self.copy_file(str(Path(__file__).parent / PTH), str(target))

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        return [*super().get_outputs(include_bytecode), str(Path(self.build_lib) / PTH)]


setup(cmdclass={"build_py": BuildWithStartupHook})
