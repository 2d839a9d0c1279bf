"""Registers the "torch_lowbit" quantization method when transformers loads its model code, without
importing transformers (seconds) at `import torch_lowbit`.

Every reader of a quantization_config goes through transformers.quantizers.auto (from_pretrained,
and lm-eval's HFLM, which calls AutoQuantizationConfig.from_dict before any model code loads), so a
post-import hook on that module is early enough: a folder saved with a LowbitConfig then loads
after a plain `import torch_lowbit`.
"""
import importlib.abc
import importlib.util
import logging
import sys

_TRIGGER = "transformers.quantizers.auto"
log = logging.getLogger(__name__)


def _register() -> None:
    import transformers
    if int(transformers.__version__.split(".")[0]) < 5:  # the quantizer API torch_lowbit.hf uses is v5's
        log.debug("torch_lowbit: transformers %s < 5, the torch_lowbit quantizer is not registered",
                  transformers.__version__)
        return
    try:
        from .register import register
        register()
    except Exception as err:  # never break transformers' own import
        log.warning("torch_lowbit: could not register the transformers quantizer (%s: %s); "
                    "import torch_lowbit.hf to see the error", type(err).__name__, err)


class _AfterImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != _TRIGGER:
            return None
        sys.meta_path.remove(self)  # find the real spec with the other finders, once
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_register(module):
            exec_module(module)
            _register()

        spec.loader.exec_module = exec_then_register
        return spec


def install() -> None:
    """Registers now if transformers' model code is loaded, else once it is."""
    if _TRIGGER in sys.modules:
        _register()
    elif not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())
