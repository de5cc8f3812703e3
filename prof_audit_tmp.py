import cProfile, pstats, io, time
from megatron_hcp.local_world import LocalWorld

def prof_rank(path):
    import torch.distributed as dist
    from megatron_hcp.functional.audit import audit_rank
    pr = cProfile.Profile()
    t = time.time()
    pr.enable(); audit_rank(path); pr.disable()
    if dist.get_rank() == 0:
        s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25)
        return f"{time.time()-t:.1f}s\n" + s.getvalue()
    return None

if __name__ == "__main__":
    import sys
    from megatron_hcp.functional.harness import recipe_dir
    with LocalWorld(int(sys.argv[2]), timeout_s=600, daemon=False) as w:
        import __main__
        out = w.run(prof_rank, str(recipe_dir(sys.argv[1])))
    print(out[0][:6000])
