from adapter_fabric.cli.main import main

main()  # exits with the command's status
