"""What mlora_lab knows of Slurm: the batch script, sbatch's reading of it, and what Slurm says of a job."""
