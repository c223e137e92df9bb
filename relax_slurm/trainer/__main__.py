from relax_slurm.trainer.main import main

main()
