import { defineConfig } from 'vitest/config';
import vue from '@vitejs/plugin-vue';

// base './': the built page uses relative asset paths, so the Python server can serve dist/ at any root.
export default defineConfig({
  base: './',
  plugins: [vue()],
  server: { port: 5173, strictPort: true },
  test: { include: ['tests/**/*.test.ts'], environment: 'node' },
});
