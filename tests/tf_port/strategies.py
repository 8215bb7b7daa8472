"""The strategy factories the ported TF tests parametrize over (TF's strategy_combinations, on logical CPUs)."""

import mpistrat as ms


def mirrored_one_cpu():
    return ms.MirroredStrategy(["/cpu:0"])


def mirrored_two_cpus():
    return ms.MirroredStrategy(["/cpu:0", "/cpu:1"])


def multi_worker_one_cpu():
    return ms.MultiWorkerMirroredStrategy()


def multi_worker_two_cpus():
    return ms.MultiWorkerMirroredStrategy(local_devices=["/cpu:0", "/cpu:1"])
