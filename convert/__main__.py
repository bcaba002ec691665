def main():
    print("stub")
if __name__ == "__main__":
    main()
