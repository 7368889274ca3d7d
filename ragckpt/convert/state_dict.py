"""`ragckpt.integrations.fsdp2`'s entry points, importable from here as well, so that code written
as `from ragckpt.convert.state_dict import save_state_dict` keeps working. The FSDP2 integration
saves from the ranks of a training job; it converts no finished checkpoint."""

from ragckpt.integrations.fsdp2 import async_save_state_dict, load_state_dict, save_state_dict

__all__ = ["async_save_state_dict", "load_state_dict", "save_state_dict"]
