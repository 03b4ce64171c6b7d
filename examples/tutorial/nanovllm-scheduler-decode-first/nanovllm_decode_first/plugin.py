from nanovllm_core import hookimpl
from nanovllm_decode_first.scheduler import DecodeFirstScheduler

NANOVLLM_PLUGIN_API = ">=2,<3"


@hookimpl
def nanovllm_register_schedulers(register):
    register("decode_first", DecodeFirstScheduler)
