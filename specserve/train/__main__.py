"""`python -m specserve.train ...` == `specserve train-draft ...` (without the server's imports)."""

import argparse
import logging

from specserve.train import add_train_args, main

logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
_p = argparse.ArgumentParser(prog="specserve train-draft")
add_train_args(_p)
main(_p.parse_args())
