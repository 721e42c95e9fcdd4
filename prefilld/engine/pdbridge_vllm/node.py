"""vLLM's workers on another box of prefilld's ``[engine.nodes]``: ``prefilld node --rank N`` runs
``python -m pdbridge_vllm.node <vLLM's serve arguments> --headless``.

vLLM's headless mode (multi-node pipeline or tensor parallelism) lives in its CLI's ``serve``
subcommand; its OpenAI server module, which prefilld runs on the head, has none, and the CLI's
entry point reads the version of a distribution named ``vllm``, which vLLM's CPU build is not.
So this parses the server's own arguments and hands them to ``serve``, as ``vllm serve`` would.
"""

from vllm.entrypoints.cli.serve import ServeSubcommand
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
from vllm.utils.argparse_utils import FlexibleArgumentParser

if __name__ == "__main__":  # vLLM's workers are spawned processes that import __main__ again
    cli_env_setup()
    args = make_arg_parser(FlexibleArgumentParser(description=__doc__)).parse_args()
    if not args.headless:
        raise SystemExit("pdbridge_vllm.node runs vLLM's workers only: pass --headless")
    ServeSubcommand.cmd(args)
